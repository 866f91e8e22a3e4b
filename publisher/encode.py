"""Encode one rank's share of a version: keyframe or delta, patch by patch into blobs.

A keyframe encodes every tensor from its whole bytes (the only place the publisher moves
whole tensors to the host). A delta encodes only what `device_diff` found, and the
tensor's digest follows from the committed base's digest in O(changed elements)
(`digest_update`), so a delta never touches unchanged bytes on the host.

A delta gets the codec's `context` encoding (smaller patches) from what the codec needs
of the old tensor: on the CPU the base buffer's own bytes (a view, no copy) and the
exponent counts kept with them (`exponents`); on CUDA the `ContextHint` the device diff
computed where the tensor lives.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from deltaboard.board import codec
from deltaboard.publisher.device_diff import iter_diffs
from deltaboard.publisher.exponents import ExponentCounts
from deltaboard.publisher.packer import BlobPacker, PackedParts, Tensors
from deltaboard.publisher.snapshot import Slot, ViewBuffer, ViewLayout


@dataclass(frozen=True)
class LocalSlice:
    """Where a rank's local tensor sits in the whole tensor it is a slice of: the box at
    `offset` of the local tensor's shape (docs/contract.md, "Parts"). `order` is the whole
    tensor's position in the trainer's state, which orders the manifest (and so the shard
    files) as an unsharded publisher would."""

    tensor_shape: tuple[int, ...]
    offset: tuple[int, ...]
    order: int


@dataclass(frozen=True)
class RankVersion:
    """What one rank contributes to a version (picklable: it is gathered to rank 0)."""

    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # every owned tensor: name, dtype, shape
    parts: PackedParts  # encoded tensors (all for a keyframe, changed ones for a delta)
    digests: Mapping[str, str]  # every owned tensor's digest after this version
    changed_elements: int
    total_elements: int
    view_bytes: int
    host_bytes: int  # bytes of changes the diff moved from the device to the host
    diff_s: float  # time spent waiting for the diff, beyond what encoding hid (0 for keyframes)
    hint_bytes: int = 0  # bytes of context hints moved to the host besides (CUDA deltas)
    slices: Mapping[str, LocalSlice] = field(default_factory=dict)  # sharded: where each sits
    slice_digests: Mapping[str, str] = field(default_factory=dict)  # each slice's at global positions


Encoded = tuple[codec.PatchBatch, list[str | None] | None]
"""A bundle's patches (each with the digest of the local tensor it produces) and, per
tensor, a slice's digest at its positions in the whole tensor (None: not a slice; the
list None where no tensor of the bundle is one)."""


def _keyframes(
    buffer: ViewBuffer, slots: list[Slot], slices: Mapping[str, LocalSlice], counts: ExponentCounts | None
) -> Encoded:
    patches: list[bytes] = []
    digests: list[str] = []
    global_digests: list[str | None] = []
    for slot in slots:
        data = buffer.host_bytes(slot)
        patches.append(codec.keyframe(data, slot.dtype))
        digests.append(codec.read_header(patches[-1]).result_digest)
        global_digest = None
        if (where := slices.get(slot.name)) is not None:
            global_digest = codec.digest_slice(data, slot.dtype, where.offset, slot.shape, where.tensor_shape)
        global_digests.append(global_digest)
    host = [s for s in slots if s.device == "cpu"]
    if counts is not None and host:  # the next delta starts from them
        counts.count([s.name for s in host], [(buffer.host_bytes(s), s.dtype) for s in host])
    # one patch (a large tensor's bundle) is joined without a copy
    ends = list(itertools.accumulate(len(p) for p in patches))
    return codec.PatchBatch(b"".join(patches), ends, digests), global_digests if slices else None


Where = tuple[LocalSlice, tuple[int, ...], str]  # a slice's place, local shape, global digest before


def _deltas(
    changes: codec.ChangeColumns,
    base_digests: list[str],
    wheres: list[Where | None],
    old: tuple[np.ndarray, list[int]] | None,
    hints: codec.HintColumns | None,
    kept: tuple[ExponentCounts, Sequence[str]] | None,
) -> Encoded:
    """A bundle of tensors' patches in one codec call (`codec.encode_batch`): against the old
    bytes in place (`old`: a buffer and each tensor's first element) or with the device's
    hints, or neither (no context encoding). `kept`: the old bytes' exponent counts and the
    bundle's names, whose rows the patches move in place."""
    buffer, starts = old if old is not None else (None, None)
    counts, names = kept if kept is not None else (None, [])
    rows = None if counts is None else counts.take(names)
    patches = codec.encode_batch(
        changes, base_digests, old=buffer, old_starts=starts, hints=hints, counts=rows
    )
    if counts is not None and rows is not None:
        counts.put(names, rows)
    if not any(wheres):
        return patches, None
    global_digests: list[str | None] = [None] * len(changes)
    for i, where in enumerate(wheres):
        if where is not None:  # the slice's digest moves by its changes at their global positions
            c = changes.tensor(i)
            at, shape, base_global = where
            positions = codec.slice_positions(c.positions, at.offset, shape, at.tensor_shape)
            moved = codec.Changes(c.dtype, math.prod(at.tensor_shape), positions, c.old_bits, c.new_bits)
            global_digests[i] = codec.digest_update(base_global, moved)
    return patches, global_digests


Bundle = tuple[Tensors, Callable[[], Encoded]]
"""Tensors (as the packer takes them) and the call that encodes them all, in order."""


def encode_rank(
    buffer: ViewBuffer,
    base: ViewBuffer | None,
    base_digests: Mapping[str, str],
    packer: BlobPacker,
    encoders: Executor,
    window: int,
    context: bool | None = None,
    slices: Mapping[str, LocalSlice] | None = None,
    base_slice_digests: Mapping[str, str] | None = None,
    while_uploading: Callable[[RankVersion], None] | None = None,
) -> RankVersion:
    """Encode `buffer` as a keyframe (`base` None) or as a delta against `base`.

    Tensors are encoded in parallel on `encoders` (the codec's compiled and zstd work
    releases the GIL), in bundles of small tensors (`BUNDLE_ELEMENTS`; a delta's bundle is
    one `codec.encode_batch` call), at most `window`
    bundles at a time, and packed in layout order, so blobs and manifests do not depend on
    thread timing and a keyframe holds at most `window` bundles' host bytes and patches
    while the packer waits for the link.
    `context` asks for the codec's context encoding: None (the default) and True
    everywhere (the old bytes on the host, a device hint on CUDA: `device_diff.device_hints`),
    False nowhere (see `Publisher`).
    `slices` (sharded state): where each local tensor sits in its whole tensor; each
    slice's digest at global positions is kept up to date from `base_slice_digests`.
    With the context encoding, the host tensors' exponent counts move from `base` to
    `buffer` (`ViewBuffer.exponent_counts`): a keyframe counts them, a delta moves the
    base's by its changes (`exponents`).
    `while_uploading` is called with the version once its last blob is sealed, while the
    blobs still upload (the version is returned once they are all uploaded): the
    publisher makes the manifest then, not after the upload of a delta's last blob.
    """
    layout = buffer.layout
    slices = slices or {}
    missing = [s.name for s in layout.slots if s.name not in slices] if slices else []
    if missing:
        raise ValueError(
            f"the view of sharded tensors holds {missing[:3]}, slices of no tensor (FP8 scales?)"
        )
    tensors, total = layout.tensors, layout.numel
    digests: dict[str, str] = {}  # a keyframe's are its own tensors' (names may have changed)
    global_digests: dict[str, str] = {}
    counts = None if context is False else _host_counts(layout, base)
    if base is None:
        numels = [s.numel for s in layout.slots]
        keyframes: list[Bundle] = []
        for a, b in _bundles(numels):
            group = list(layout.slots[a:b])
            columns = Tensors(
                [s.name for s in group], [s.dtype for s in group], [s.shape for s in group], numels[a:b]
            )
            keyframes.append((columns, partial(_keyframes, buffer, group, slices, counts)))
        _encode_in_order(keyframes, encoders, window, packer, digests, global_digests)
        diffed = _Diffed(changed=total)  # a keyframe: every element, nothing diffed
    else:
        base.exponent_counts = None  # moved in place by this version's patches: the new view's
        digests.update(base_digests)
        global_digests.update(base_slice_digests or {})
        diffed = _Diffed()
        with contextlib.closing(
            _delta_bundles(base, buffer, base_digests, context, slices, global_digests, counts, diffed)
        ) as deltas:
            _encode_in_order(deltas, encoders, window, packer, digests, global_digests)
    version = RankVersion(
        tensors,
        packer.seal(),
        digests,
        diffed.changed,
        total,
        layout.view_bytes,
        diffed.host_bytes,
        diffed.waited_s,
        diffed.hint_bytes,
        slices=dict(slices),
        slice_digests=global_digests,
    )
    if while_uploading is not None:
        while_uploading(version)
    packer.wait()
    buffer.exponent_counts = counts
    return version


@dataclass
class _Diffed:
    """What `_delta_bundles` found while the bundles went by: changed elements, bytes moved
    to the host (the part of them that carried context hints), and time spent waiting for
    the diff that encoding did not hide."""

    changed: int = 0
    host_bytes: int = 0
    hint_bytes: int = 0
    waited_s: float = 0.0


def _delta_bundles(
    base: ViewBuffer,
    buffer: ViewBuffer,
    base_digests: Mapping[str, str],
    context: bool | None,
    slices: Mapping[str, LocalSlice],
    global_digests: Mapping[str, str],
    counts: ExponentCounts | None,
    diffed: _Diffed,
) -> Generator[Bundle, None, None]:
    """A delta's bundles, diff batch after diff batch, made as the encoders take them: the
    next batch is finished (its changes gathered) and cut into bundles while the encoders
    still run the last batch's, not after all of them came back. A bundle's changes and
    hints are slices of the batch's columns; what is still a step per tensor is the
    bundle's lists of digests and shapes (for the packer and the counts)."""
    started = time.perf_counter()
    # device hints where they are the context's source (CUDA), never on the CPU, which
    # hands the codec the old bytes: `context=True` means the encoding, not a device pass
    for part in iter_diffs(base, buffer, hints=False if context is False else None):
        diffed.waited_s += time.perf_counter() - started  # not hidden by encoding
        names, changes, changed_slots = part.names, part.columns, part.slots
        counted = changes.counts.tolist()
        diffed.changed += int(changes.bounds[-1])
        diffed.host_bytes += part.host_bytes - part.hint_bytes
        diffed.hint_bytes += part.hint_bytes
        for a, b in _bundles(counted):
            group_names = names[a:b]
            in_group = changed_slots[a:b]
            wheres: list[Where | None] = [None] * len(group_names)
            if slices:
                wheres = [_where(slices, global_digests, s) for s in in_group]
            old = _old_bytes(base, in_group, context)
            # the device's hints, where it computed them (CUDA, context not off)
            hints = None if part.hint_columns is None else part.hint_columns.take(a, b, changes.bounds)
            encode = partial(
                _deltas,
                changes.take(a, b),
                [base_digests[name] for name in group_names],
                wheres,
                old,
                hints,
                None if old is None or counts is None else (counts, group_names),
            )
            columns = Tensors(group_names, changes.dtypes[a:b], [s.shape for s in in_group], counted[a:b])
            yield columns, encode
        started = time.perf_counter()


def _host_counts(layout: ViewLayout, base: ViewBuffer | None) -> ExponentCounts | None:
    """The exponent counts of the layout's host tensors that this version starts from: the
    base's where it kept them, else none known yet (None: no tensor on the host)."""
    if base is not None and base.exponent_counts is not None:
        return base.exponent_counts
    return ExponentCounts(layout.host_tensors) if layout.host_tensors else None


def _where(slices: Mapping[str, LocalSlice], global_digests: Mapping[str, str], slot: Slot) -> Where | None:
    """A sliced tensor's place, local shape and global digest before this delta."""
    at = slices.get(slot.name)
    return None if at is None else (at, slot.shape, global_digests[slot.name])


def _old_bytes(
    base: ViewBuffer, slots: Sequence[Slot], context: bool | None
) -> tuple[np.ndarray, list[int]] | None:
    """What the codec's context encoding reads for a bundle (of one group) on the host: the
    old bytes in place (CUDA bundles take the device's hints instead; with neither, the
    codec falls back to its context-free encodings)."""
    if context is False or slots[0].device != "cpu":
        return None
    return base.host_group(slots[0].group), [s.offset for s in slots]


BUNDLE_ELEMENTS = 1 << 16
"""Tensors are handed to the encoder pool in bundles of at least this much work (changed
elements; a keyframe's whole elements), so that a model of many small tensors pays one
task per bundle, not per tensor; a large tensor is a bundle of its own."""


def _bundles(work: Sequence[int]) -> list[tuple[int, int]]:
    """The ranges [a, b) of consecutive items (of `work` each, not negative) that make a
    bundle: each holds `BUNDLE_ELEMENTS` of work, but the last. A search of the running
    sums per bundle, not a step per item (a delta of 20,000 small tensors has ~90 bundles)."""
    total = list(itertools.accumulate(work))
    out: list[tuple[int, int]] = []
    start, before = 0, 0
    while start < len(total):
        # the first item whose running sum reaches the bundle's work
        last = bisect.bisect_left(total, before + BUNDLE_ELEMENTS, lo=start)
        if last == len(total):
            out.append((start, last))
            break
        out.append((start, last + 1))
        start, before = last + 1, total[last]
    return out


def _encode_in_order(
    bundles: Iterable[Bundle],
    encoders: Executor,
    window: int,
    packer: BlobPacker,
    digests: dict[str, str],
    global_digests: dict[str, str],
) -> None:
    """Run `bundles` on `encoders` (at most `window` submitted) and pack the results in order."""
    pending: deque[tuple[Tensors, Future[Encoded]]] = deque()

    def pack_first() -> None:
        tensors, fut = pending.popleft()
        patches, slice_digests = fut.result()
        digests.update(zip(tensors.names, patches.digests, strict=True))
        if slice_digests is not None:
            pairs = zip(tensors.names, slice_digests, strict=True)
            global_digests.update((n, d) for n, d in pairs if d is not None)
        packer.add(tensors, patches.data, patches.ends, patches.digests)

    try:
        for items, encode in bundles:
            pending.append((items, encoders.submit(encode)))
            if len(pending) >= window:
                pack_first()
        while pending:
            pack_first()
    finally:
        for _, fut in pending:
            fut.cancel()
