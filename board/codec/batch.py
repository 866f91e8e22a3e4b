"""`encode_changes` for many tensors at once: one compiled call per batch.

A model of many small tensors (an MoE model has one per expert projection) pays the
encoder's fixed cost per patch: validating the changes, the context hint, the ranks, the
values, the digest, each a compiled call with its own dispatch, and the Python between
them. Here one compiled call runs every step for every tensor of a batch and writes all
the payloads into one buffer, and their headers are written as columns around them
(`header.pack_many`): the patches come out end to end in one buffer, no object per patch.

The bytes are `encode_changes`' bytes, tensor by tensor (`tests/board/test_codec_batch.py`):
the kernel takes the same decisions (the context encoding when its hint pays, else
`sparse`), and a tensor with more than 1/8 of its elements changed, where `dense` or
`replace` may win, goes through `encode_changes` itself.

The context hint starts from the old tensor's exponent counts (`plan_thresholds`, step 2),
which for a small tensor means counting every element, a pass over the tensor per
version. A caller that encodes version after version keeps them instead (`counts`): a
patch moves them by its changes alone, in place, so that after the batch they are each
tensor's counts after its patch, for the next version's batch to start from (in place:
a copy in and out of a row per tensor is what a model of many small tensors would pay).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from deltaboard.board.codec import api
from deltaboard.board.codec.bitio import put_index_sets
from deltaboard.board.codec.changes import Changes, check_positions
from deltaboard.board.codec.classes import split_by_class
from deltaboard.board.codec.columns import ChangeColumns, HintColumns, one_width
from deltaboard.board.codec.context import EXPONENT_FIELDS, count_exponents, sample_stride
from deltaboard.board.codec.digest import change_sums, raw_digests
from deltaboard.board.codec.dtypes import as_bits, dtype_code
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.header import ENCODINGS, pack_many
from deltaboard.board.codec.jit import kernel
from deltaboard.board.codec.ranked import ContextHint, host_hint, put_ranks
from deltaboard.board.codec.values import layout, put_values

_SPARSE, _CONTEXT = ENCODINGS.index("sparse"), ENCODINGS.index("context")
_GENERAL = -1  # encoded by `encode_changes` (dense or replace may win)
# per tensor, how its context hint is had: none (sparse), from the old bits, or given
_NO_HINT, _FROM_OLD, _GIVEN = 0, 1, 2
# failures the kernel reports per tensor, raised as `encode_changes` raises them
_FAILURES = {
    1: "changes: a position lies outside the tensor",
    2: "changes: positions are not strictly increasing",
    3: "context hint: bad thresholds",
    4: "context hint: a rank outside its class",
    5: "context hint: ranks not increasing within a class",
}
_DENSE_FROM = 8  # as `api`: more than numel / 8 changed may take a bitmap or the tensor


@kernel
def _encode_all(
    old: np.ndarray,
    old_starts: np.ndarray,
    numels: np.ndarray,
    bounds: np.ndarray,
    positions: np.ndarray,
    old_bits: np.ndarray,
    new_bits: np.ndarray,
    modes: np.ndarray,
    fields: np.ndarray,
    thresholds: np.ndarray,
    ranks: np.ndarray,
    lanes: np.ndarray,
    counts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(payloads end to end, each one's end, its encoding, status) for every tensor;
    `lanes` (base digest lanes in, result lanes out) and `counts` are updated in place.

    Tensor i: changes `bounds[i]:bounds[i + 1]` of `positions`, `old_bits`, `new_bits`;
    its old bits `old[old_starts[i]:][:numels[i]]` (mode `_FROM_OLD`); `fields[i]` its
    exponent field (shift, mask, element mask); `thresholds[i]` and the ranks at its
    changes, a given hint (mode `_GIVEN`); `counts[i]` its old exponent counts where
    `counts[i, 0] >= 0` (mode `_FROM_OLD`; a row of no columns: none kept), moved in place
    by its changes (first entry -1 where none were taken).
    """
    count = numels.size
    kept = counts.shape[1] > 0
    # the planner's counts, reused from tensor to tensor (a row each is what a model of
    # many small tensors would allocate, fill and copy per tensor)
    columns = int(fields[:, 1].max()) + 1 if count else 1
    before_counts = np.empty(columns, dtype=np.int64)
    changed = np.empty(columns, dtype=np.int64)
    no_row = np.empty(0, dtype=np.int64)
    buf = np.zeros(max(256, 8 * positions.size), dtype=np.uint8)
    ends = np.zeros(count, dtype=np.int64)
    encodings = np.full(count, _SPARSE, dtype=np.int64)
    status = np.zeros(count, dtype=np.int64)
    sign = (np.uint64(1) << np.uint64(8 * old_bits.itemsize - 1)) - np.uint64(1)
    at = 0
    for i in range(count):
        a, b = bounds[i], bounds[i + 1]
        n, numel = b - a, numels[i]
        pos, before, after = positions[a:b], old_bits[a:b], new_bits[a:b]
        status[i] = check_positions(pos, numel)
        if status[i] == 0 and n * _DENSE_FROM > numel:
            encodings[i] = _GENERAL
        if status[i] or encodings[i] == _GENERAL:
            if kept:
                counts[i, 0] = -1
            ends[i] = at
            continue
        shift, mask, element = int(fields[i, 0]), int(fields[i, 1]), fields[i, 2]
        t_low, t_top = thresholds[i, 0], thresholds[i, 1]
        tensor_ranks = ranks[a:b]
        hinted = False
        if modes[i] == _FROM_OLD and n and mask:
            tensor_old = old[old_starts[i] : old_starts[i] + numel]
            stride = sample_stride(numel)
            row = counts[i, : mask + 1] if kept else no_row
            if kept and row[0] >= 0:
                sampled = before_counts[: mask + 1]
                sampled[:] = row
            else:
                sampled = count_exponents(tensor_old, shift, mask, stride)
                if kept:
                    row[:] = sampled
            _count_changes(changed[: mask + 1], row, stride, pos, before, after, shift, mask)
            t_low, t_top, tensor_ranks = host_hint(tensor_old, pos, shift, mask, sampled, changed[: mask + 1])
            hinted = t_low >= 0
        else:
            if kept:
                counts[i, 0] = -1
            if modes[i] == _GIVEN and n:
                hinted = mask > 0 and 0 <= t_low <= t_top <= mask + 1
                status[i] = 0 if hinted else 3
        if hinted:
            limits = np.empty(3, dtype=old_bits.dtype)  # in the element's own type
            limits[0] = sign
            limits[1] = np.uint64(t_low) << np.uint64(shift)
            limits[2] = np.uint64(t_top) << np.uint64(shift)
            r0, r1, r2, split = split_by_class(before, pos, tensor_ranks, limits[0], limits[1], limits[2])
            if split:
                status[i] = split + 3
            else:
                encodings[i] = _CONTEXT
                buf, at = put_ranks(buf, at, t_low, t_top, r0, r1, r2)
        if status[i] == 0 and encodings[i] == _SPARSE:
            buf, at = put_index_sets(buf, at, pos, np.array([0, n], dtype=np.int64))
        if status[i] == 0:
            buf, at = put_values(buf, at, before, after, shift, mask, element)
            da, db = change_sums(pos, before, after)
            lanes[i, 0] += da
            lanes[i, 1] += db
        ends[i] = at
    return buf, ends, encodings, status


@kernel
def _count_changes(
    changed: np.ndarray,
    counts: np.ndarray,
    stride: int,
    positions: np.ndarray,
    old_bits: np.ndarray,
    new_bits: np.ndarray,
    shift: int,
    mask: int,
) -> None:
    """`changed`: the exponent counts of the changed elements' old bits; and `counts` (the
    tensor's elements at `stride`; none where it has no entries) moved by the changes in
    place: a sampled change leaves its old exponent and joins its new one. One pass over
    the changes into one histogram (`count_exponents` zeroes and sums eight, which costs
    more than a tensor's few hundred changes)."""
    changed[:] = 0
    moves = counts.size > 0
    for j in range(positions.size):
        old = (int(old_bits[j]) >> shift) & mask
        changed[old] += 1
        if moves and positions[j] % stride == 0:
            counts[old] -= 1
            counts[(int(new_bits[j]) >> shift) & mask] += 1


@dataclass(frozen=True)
class PatchBatch:
    """A batch's patches end to end in one buffer (`data`; patch i ends at `ends[i]`) and
    each one's result digest: what a packer appends to a blob in one piece, with no object
    per patch."""

    data: bytes
    ends: list[int]
    digests: list[str]

    def __iter__(self) -> Iterator[tuple[bytes, str]]:
        """Each patch (a copy) and its digest, in order."""
        for (start, end), digest in zip(itertools.pairwise([0, *self.ends]), self.digests, strict=True):
            yield self.data[start:end], digest


def encode_batch(
    changes: Sequence[Changes] | ChangeColumns,
    old_digests: Sequence[str],
    *,
    old: np.ndarray | None = None,
    old_starts: Sequence[int] | np.ndarray | None = None,
    hints: Sequence[ContextHint | None] | HintColumns | None = None,
    counts: np.ndarray | None = None,
) -> PatchBatch:
    """Each tensor's patch and its result digest: byte for byte what
    `encode_changes(changes[i], old_i, dtype, old_digest=old_digests[i], hint=hints[i])` gives.

    `changes` and `hints` come as separate objects or as columns (`ChangeColumns`,
    `HintColumns`: how the publisher's diff hands them over, with no object per tensor).
    `old` (raw bytes, as everywhere) holds every tensor's old elements, tensor i's from
    element `old_starts[i]` on (several tensors of a view buffer, in place); without it
    there is no `replace` and, without `hints` too, no context encoding. Every tensor's
    elements have one width.

    `counts` (int64, a row per tensor of at least mask + 1 columns of the widest exponent
    field among the tensors) keeps the exponent counts from one version to the next: row
    i, where its first entry is not -1, is `exponent_counts` of tensor i's old elements at
    `sample_stride(numel)`, taken as they are instead of counted from `old` (wrong counts
    give valid patches, not `encode_changes`' bytes). The batch moves them in place: after
    it, row i is tensor i's counts after its patch, or has a first entry of -1 where the
    batch took none (no context hint from `old`: not floating, or left to
    `encode_changes`). A batch that raises `PatchError` leaves them part moved.
    """
    if not len(changes):
        return PatchBatch(b"", [], [])
    if len(old_digests) != len(changes) or (hints is not None and len(hints) != len(changes)):
        raise PatchError("encode_batch: one base digest (and hint) per tensor expected")
    columns = _checked(changes if isinstance(changes, ChangeColumns) else ChangeColumns.of(changes))
    if hints is not None and not isinstance(hints, HintColumns):
        hints = HintColumns.of(hints, columns.bounds)
    bits_dtype = columns.old_bits.dtype
    kinds = set(columns.dtypes)
    numels, bounds = columns.numels, columns.bounds
    old_bits = np.empty(0, dtype=bits_dtype) if old is None else as_bits(old, columns.dtypes[0], "old")
    starts = (
        np.zeros(len(columns), dtype=np.int64) if old_starts is None else np.asarray(old_starts, np.int64)
    )
    if old is not None and (
        starts.shape != numels.shape or (starts < 0).any() or (starts + numels > old_bits.size).any()
    ):
        raise PatchError(f"old has {old_bits.size} elements, fewer than the tensors' at their starts")
    bases = raw_digests(old_digests)
    lanes = np.frombuffer(bases, dtype=">u8").astype(np.uint64).reshape(-1, 2)
    modes, thresholds, ranks = _hints(len(columns), old is not None, hints, bounds)
    dtypes = {
        dtype: (*EXPONENT_FIELDS.get(dtype, (0, 0)), layout(dtype)[2], dtype_code(dtype)) for dtype in kinds
    }
    # one row per tensor: exponent shift, exponent mask, element mask, dtype code
    rows = np.array(list(dtypes.values()), np.uint64)
    if len(dtypes) == 1:
        per_tensor = np.broadcast_to(rows, (len(columns), rows.shape[1]))
    else:
        which = {dtype: i for i, dtype in enumerate(dtypes)}
        per_tensor = rows[[which[dtype] for dtype in columns.dtypes]]
    fields = np.ascontiguousarray(per_tensor[:, :3])
    width = max(int(f[1]) + 1 for f in dtypes.values())
    if counts is not None and (
        counts.dtype != np.int64
        or counts.shape[:1] != numels.shape
        or (counts.ndim != 2 or counts.shape[1] < width)
    ):
        raise PatchError(f"encode_batch: counts of {len(columns)} x {width} int64 expected")
    payloads, ends, encodings, status = _encode_all(
        old_bits,
        starts,
        numels,
        bounds,
        columns.positions.astype(np.int64, copy=False),
        columns.old_bits,
        columns.new_bits,
        modes,
        fields,
        thresholds,
        ranks,
        lanes,
        np.empty((len(columns), 0), np.int64) if counts is None else counts,
    )
    failed = np.flatnonzero(status)
    if failed.size:
        raise PatchError(_FAILURES[int(status[failed[0]])])
    # every patch framed in one call, as columns; a tensor left to `encode_changes` gets an
    # empty frame there, replaced by its patch below
    results = lanes.astype(">u8").tobytes()
    data, patch_ends = pack_many(
        per_tensor[:, 3].astype(np.uint8),
        encodings,
        numels,
        np.diff(bounds),
        bases,
        results,
        payloads,
        ends,
    )
    hexed = results.hex()  # every result digest in one call, as `bases` were parsed
    digests = [hexed[at : at + 32] for at in range(0, len(hexed), 32)]
    general = np.flatnonzero(encodings == _GENERAL).tolist()
    if not general:
        return PatchBatch(data, patch_ends.tolist(), digests)
    pieces, sizes, at = [], np.diff(patch_ends, prepend=0), 0
    for i in general:
        c = columns.tensor(i)
        tensor_old = None if old is None else old_bits[starts[i] : starts[i] + c.numel].view(np.uint8)
        hint = None if hints is None else hints.hint(i, bounds)
        patch = api.encode_changes(c, tensor_old, c.dtype, old_digest=old_digests[i], hint=hint)
        pieces += [data[at : patch_ends[i] - sizes[i]], patch]
        at, sizes[i], digests[i] = patch_ends[i], len(patch), api.read_header(patch).result_digest
    pieces.append(data[at:])
    return PatchBatch(b"".join(pieces), np.cumsum(sizes).tolist(), digests)


def _checked(columns: ChangeColumns) -> ChangeColumns:
    """`columns` as the kernel reads them (bit patterns of the tensors' one width), or
    PatchError where their arrays disagree."""
    bits = one_width(columns.dtypes)
    changed = columns.positions.shape
    if (
        columns.bounds.shape != (len(columns) + 1,)
        or columns.numels.shape != (len(columns),)
        or len(changed) != 1
        or columns.old_bits.shape != changed
        or columns.new_bits.shape != changed
        or columns.bounds[0] != 0
        or columns.bounds[-1] != changed[0]
        or (np.diff(columns.bounds) < 0).any()
    ):
        raise PatchError("changes: positions, old_bits and new_bits differ in length")
    if columns.old_bits.dtype.itemsize != bits.itemsize or columns.new_bits.dtype.itemsize != bits.itemsize:
        raise PatchError("encode_batch: tensors of one element width expected")
    return replace(columns, old_bits=columns.old_bits.view(bits), new_bits=columns.new_bits.view(bits))


def _hints(
    count: int, has_old: bool, hints: HintColumns | None, bounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mode, given thresholds, given ranks at the changes) per tensor, as `encode_changes`
    decides: a given hint as given, else one from the old bits of a floating tensor."""
    modes = np.full(count, _FROM_OLD if has_old else _NO_HINT, dtype=np.int64)
    if hints is None:
        return modes, np.zeros((count, 2), dtype=np.int64), np.zeros(0, dtype=np.int64)
    if hints.thresholds.shape != (count, 2) or hints.ranks.shape != (int(bounds[-1]),):
        raise PatchError("context hint: one rank per changed element expected")
    given = hints.thresholds[:, 0] >= 0
    modes[given] = _GIVEN
    return modes, np.where(given[:, None], hints.thresholds, 0), hints.ranks.astype(np.int64, copy=False)
