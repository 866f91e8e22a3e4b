"""The diff of two view buffers on their own device, moving only changes to the host.

`deltaboard.board.codec.diff` does the same on host numpy arrays; here the comparison runs where
the tensors live (CUDA when the parameters are there), so the device->host traffic is
the changed positions and their old and new bit patterns, never a whole tensor: the old
bits are the context the codec conditions on, the new bits what it encodes. Bit
patterns are compared as integers, so -0/+0 differ and an unchanged NaN is unchanged.

For tensors off the host (CUDA) the diff also computes each changed tensor's
`board.codec.ContextHint` there (by default, `device_hints`): the codec's context encoding
needs the class of every element of the old tensor, which would otherwise mean copying
the old tensor to the host. The device follows the codec's public planning contract
(`codec.plan_thresholds` states it: the same sampled exponent counts, the thresholds
chosen from them on the host, the same comparisons on the sign-less bit patterns) and
only the counts and one rank per changed element cross. The sampled counts follow the
changes (`sampled_counts`): after a tensor's first hint, a version's hint work is
proportional to its changes, but for the rank pass over the tensors whose classes pay off.
On the CPU the publisher hands the codec the old bytes themselves (no copy).

The view is diffed in batches of consecutive tensors (`batches`); within a batch the
comparison walks in chunks of `CHUNK_ELEMENTS` so that the transient mask costs at most
that many bytes, whatever the view's size.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from deltaboard.board import codec
from deltaboard.publisher import fused_diff
from deltaboard.publisher.sampled_counts import SampledCounts
from deltaboard.publisher.snapshot import Slot, SlotBatch, ViewBuffer, ViewLayout, as_batch, word_aligned

CHUNK_ELEMENTS = 1 << 27
RANK_CHUNK_ELEMENTS = 1 << 26  # class counts: int32 cumulative sums of at most this many
CPU_BATCH_BYTES = 1 << 25
CUDA_BATCH_BYTES = 1 << 30
# slots a batch holds at most: a model of thousands of small tensors is diffed in several
# batches, so that the encoding of one overlaps the diff of the next (an H200's 1 GB batch
# of 20,000 tensors was diffed whole, hints and all, before its first tensor encoded)
BATCH_SLOTS = 2048
CUDA_AHEAD = 4  # batches whose kernels and copies run ahead of the one the caller takes (`iter_diffs`)
CUDA_HINT_LANES = 2  # with hints, batches diffed at once, each on a pass stream of its own


@dataclass(frozen=True)
class BatchDiff:
    """A diff batch's changes as the encoder takes them: the changed slots (in layout order)
    and their names, and their changes and context hints as columns, no object per tensor
    (a model of thousands of small tensors paid one per tensor, under the GIL that the next
    batches' kernel launches wait for); and how many bytes crossed to the host."""

    slots: Sequence[Slot]
    names: Sequence[str]
    columns: codec.ChangeColumns
    hint_columns: codec.HintColumns | None = None
    host_bytes: int = 0
    hint_bytes: int = 0  # the part of host_bytes that carried context hints

    @property
    def changes(self) -> dict[str, codec.Changes]:
        """Per changed tensor, its `Changes` (views)."""
        return {name: self.columns.tensor(i) for i, name in enumerate(self.names)}

    @property
    def hints(self) -> dict[str, codec.ContextHint]:
        """Per hinted tensor, its `ContextHint`."""
        if self.hint_columns is None:
            return {}
        found = ((name, self.hint_columns.hint(i, self.columns.bounds)) for i, name in enumerate(self.names))
        return {name: hint for name, hint in found if hint is not None}


@dataclass
class ViewDiff:
    """Per changed tensor, its `Changes`; and how many bytes crossed to the host."""

    changes: dict[str, codec.Changes] = field(default_factory=dict)
    hints: dict[str, codec.ContextHint] = field(default_factory=dict)
    host_bytes: int = 0
    hint_bytes: int = 0  # the part of host_bytes that carried context hints

    @property
    def changed_elements(self) -> int:
        return sum(c.count for c in self.changes.values())


def _nonzero_ne(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Indices where `old != new`, found chunk by chunk (bounded transient mask)."""
    parts = [
        torch.ne(old[start : start + CHUNK_ELEMENTS], new[start : start + CHUNK_ELEMENTS]).nonzero().flatten()
        + start
        for start in range(0, max(old.numel(), 1), CHUNK_ELEMENTS)
    ]
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def _changed(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-global positions whose bits differ (ascending), with their old and new bits.

    Narrow elements are compared as whole 64-bit words first (the buffers are padded to
    words): the full pass then reads memory at close to its bandwidth and the scan for
    changes runs over 8/width times fewer entries. Only the changed words are gathered,
    and viewed back as their elements (little-endian lanes) to find which changed.
    """
    width = old.element_size()
    if width == 8:
        pos = _nonzero_ne(old, new)
        return pos, old[pos], new[pos]
    per = 8 // width
    old_w, new_w = old.view(torch.int64), new.view(torch.int64)
    words = _nonzero_ne(old_w, new_w)
    old_lanes = old_w[words].view(old.dtype).view(-1, per)
    new_lanes = new_w[words].view(old.dtype).view(-1, per)
    rows, lane = torch.ne(old_lanes, new_lanes).nonzero(as_tuple=True)
    return words[rows] * per + lane, old_lanes[rows, lane], new_lanes[rows, lane]


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8}


class HostCopy:
    """Small device tensors on their way to the host (`to_host`); `wait()` gives them, in
    the order given. They are packed widest element first, so that every array starts
    aligned on the host (the codec's compiled code reads them in place)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = tensors
        self._order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
        self._host: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None
        if tensors[0].device.type == "cpu":
            return
        device = tensors[0].device
        packed = torch.cat([tensors[i].reshape(-1).view(torch.uint8) for i in self._order])
        stream = _stream(device, "copy")
        stream.wait_stream(torch.cuda.current_stream(device))
        self._host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(stream):
            self._host.copy_(packed, non_blocking=True)
            packed.record_stream(stream)
            self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._done.record()

    def wait(self) -> list[np.ndarray]:
        if self._host is None:
            return [t.numpy() for t in self._tensors]
        assert self._done is not None
        self._done.synchronize()
        flat = self._host.numpy()
        out: list[np.ndarray] = [flat] * len(self._tensors)
        offset = 0
        for i in self._order:
            t = self._tensors[i]
            size = t.numel() * t.element_size()
            out[i] = flat[offset : offset + size].view(_NUMPY[t.dtype]).reshape(t.shape)
            offset += size
        return out


_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()  # the diff's helper threads ask for streams concurrently


def _stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """A stream of the publisher's own per device and role: "pass0", "pass1", ... (one per
    lane, `iter_diffs`), where the diff's kernels run, so that the trainer's stream waits
    for nothing but its snapshot copies; "copy", where the device->host copies run while
    the next batches' kernels do."""
    with _streams_lock:
        if (device, role) not in _streams:
            _streams[(device, role)] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return _streams[(device, role)]


def to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Small device tensors on the host, in one copy into pinned memory.

    The only device->host traffic of the diff. One packed copy into page-locked memory
    (torch's caching host allocator reuses the blocks) runs at the bus' speed, where one
    pageable copy per array would pay a staging copy and a synchronisation each. The copy
    runs on a stream of its own (`HostCopy`), so a caller that starts it before its next
    kernels overlaps the two. CPU tensors are returned as they are (numpy views, no copy).
    """
    return HostCopy(tensors).wait()


@functools.lru_cache(maxsize=16)
def batches(layout: ViewLayout, batch_bytes: int) -> tuple[SlotBatch, ...]:
    """Consecutive slots of one group, about `batch_bytes` each and `BATCH_SLOTS` at most:
    the unit of the pipeline. Made once per layout (cached): every version diffs the same
    batches, and the tables cached per batch are then found by the batch's kept hash
    (`SlotBatch`)."""
    out: list[list[Slot]] = []
    size, group = 0, None
    for slot in layout.slots:
        nbytes = slot.numel * slot.width
        if (slot.device, slot.width) != group or size + nbytes > batch_bytes or len(out[-1]) >= BATCH_SLOTS:
            out.append([])
            size, group = 0, (slot.device, slot.width)
        out[-1].append(slot)
        size += nbytes
    return tuple(SlotBatch(batch) for batch in out)


def _sign_less_max(bits: torch.Tensor) -> int:
    return (1 << (8 * bits.element_size() - 1)) - 1


def _exponent_keys(bits: torch.Tensor, dtype: str, offset: int) -> torch.Tensor:
    """Each element's exponent (step 1 of the contract in `codec.plan_thresholds`: the
    arithmetic shift of the signed view then the mask gives the unsigned field) plus
    `offset`, as int32."""
    shift, mask = codec.EXPONENT_FIELDS[dtype]
    return ((bits >> shift) & mask).to(torch.int32).add_(offset)


@functools.lru_cache(maxsize=256)
def _index_dtype(slots: SlotBatch) -> torch.dtype:
    """int32 slot-local indices (positions, ranks: half the bytes to the host) unless a
    tensor has 2**31 elements or more; one dtype for a batch, so that `to_host` packs them
    aligned."""
    return torch.int32 if all(slot.numel < 1 << 31 for slot in slots) else torch.int64


def _class_ranks(
    bits: torch.Tensor,
    pos: torch.Tensor,
    changed_old: torch.Tensor,
    limits: tuple[int, int],
    rank_dtype: torch.dtype,
) -> torch.Tensor:
    """Rank of each changed position within its class (step 4 of the contract in
    `codec.plan_thresholds`), the class limits as `_Plans.limits` holds them.

    Members up to each position come from cumulative counts, chunk by chunk; the
    position's own membership (known from its old bits) is taken off once. `rank_dtype`
    (`_index_dtype`) holds the counts.
    """
    top = _sign_less_max(bits)
    low_max, small_max = limits
    magnitude = changed_old & top
    is_low, is_small = magnitude <= low_max, magnitude <= small_max
    below_low, below_small = is_low.to(rank_dtype).neg_(), is_small.to(rank_dtype).neg_()
    for start in range(0, bits.numel(), RANK_CHUNK_ELEMENTS):
        chunk = bits[start : start + RANK_CHUNK_ELEMENTS] & top
        end = start + chunk.numel()
        whole = start == 0 and end == bits.numel()
        local = pos if whole else (pos - start).clamp_(0, chunk.numel() - 1)
        for below, limit in ((below_low, low_max), (below_small, small_max)):
            inclusive = torch.cumsum(chunk <= limit, 0, dtype=rank_dtype)
            if whole:
                below += inclusive[local]
            else:  # past this chunk: all its members; inside: those up to it; ahead: none
                below += torch.where(
                    pos >= end, inclusive[-1], torch.where(pos >= start, inclusive[local], 0)
                )
    return torch.where(
        is_low, below_low, torch.where(is_small, below_small - below_low, pos.to(rank_dtype) - below_small)
    )


def device_hints(hints: bool | None, device: str) -> bool:
    """Whether the diff computes context hints on `device`: where asked for, and by default
    (`None`) on CUDA, where they cost the pass little since their counts follow the changes
    (design.md, "Publishing a version"); not by default on the CPU, whose codec reads the
    old bytes in place instead."""
    return hints if hints is not None else torch.device(device).type == "cuda"


Finish = Callable[[], BatchDiff]
"""What `start_diff` returns: the call that waits for a batch's copies and cuts its result."""


@torch.no_grad()
def start_diff(
    old: ViewBuffer,
    new: ViewBuffer,
    slots: Sequence[Slot],
    hints: bool | None = None,
    fused: bool | None = None,
    lane: int = 0,
    begun: fused_diff.ChangedElements | None = None,
    then: Callable[[], None] | None = None,
) -> Finish:
    """Start the changes of consecutive slots of one group (see `batches`): the kernels and
    the copy to the host are queued (on CUDA, on the pass stream), and the returned call
    waits for the copy and gives the result (`diff_slots` does both). On CUDA the kernels run
    on the pass stream of `lane` (`iter_diffs`).

    Found on the device for the whole batch at once: by the fused Triton pass
    (`fused_diff`, when `fused` asks for it) or by the torch reference (one
    comparison over the batch's range, one gather of the changed words, a `searchsorted`
    over the slots' offsets to cut the result per tensor); then one small transfer to the
    host (`HostCopy`). `hints` adds the changed tensors' context hints, whose rank pass runs
    while the changes are copied to the host (`device_hints` says when by default: on
    CUDA; the CPU path hands the codec the old bytes instead). Without hints the copy is
    left running when it returns; with hints the batch needs the host's answer in the
    middle (the counts, the thresholds) and finishes before. `begun` and `then` chain the
    fused passes of consecutive batches on one stream (`_find`).
    """
    group = slots[0].group
    # Measured on an H200 (design.md, "Publishing a version"): the torch pass is the faster
    # with hints and without, so the fused pass runs only when asked for.
    want_hints = device_hints(hints, group[0])
    use_fused = bool(fused)
    if group[0] == "cpu" and not want_hints and not use_fused:
        done = _diff_on_host(old, new, slots)
        return lambda: done
    on_cuda = torch.device(group[0]).type == "cuda"
    if on_cuda:
        # The pass stream reads the buffers only once their fills ran (on the stream that
        # filled them): a device-side wait, the host blocks for nothing.
        stream = _stream(torch.device(group[0]), f"pass{lane}")
        for buffer in (old, new):
            if buffer.ready is not None:
                stream.wait_event(buffer.ready)
    with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
        found = _find(old, new, slots, want_hints, use_fused, begun, then)
    return functools.partial(_cut, slots, found)


def diff_slots(
    old: ViewBuffer,
    new: ViewBuffer,
    slots: Sequence[Slot],
    hints: bool | None = None,
    fused: bool | None = None,
) -> BatchDiff:
    """Changes of consecutive slots of one group (`start_diff`, waited for). What is cached
    per batch (device tables, the pass' expected count, the kept counts' rows) is found by
    the batch object itself (`SlotBatch`): diff the same slots again with the same batch,
    one of `batches`, not a new sequence each time."""
    return start_diff(old, new, slots, hints, fused)()


Found = Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, "Hints | None"]]
"""`_find`'s answer: the call that gives (slot-local positions, per-slot counts, old bits,
new bits, the hints' parts) on the host, waiting for the copy that brings them."""


def _cut(slots: Sequence[Slot], found: Found) -> BatchDiff:
    """A batch's result as columns, once its arrays are on the host: the changed slots'
    changes are the found arrays themselves (in slot order), no step per slot."""
    local, counts, old_h, new_h, ranks = found()
    unsigned = codec.uint_dtype(slots[0].dtype)  # the batch's one width
    changed = np.flatnonzero(counts)
    found_slots, names, columns = _changed_columns(
        as_batch(slots), changed, counts, local, old_h.view(unsigned), new_h.view(unsigned)
    )
    host_bytes = local.nbytes + old_h.nbytes + new_h.nbytes + 8 * len(slots)
    if ranks is None:
        return BatchDiff(found_slots, names, columns, None, host_bytes)
    plans, host_ranks, hint_bytes = ranks
    hint_columns = None
    if plans.picked.size:
        thresholds = np.full((len(slots), 2), -1, dtype=np.int64)
        thresholds[plans.picked] = plans.thresholds
        hint_columns = codec.HintColumns(thresholds[changed], host_ranks)
    return BatchDiff(found_slots, names, columns, hint_columns, host_bytes + hint_bytes, hint_bytes)


def _changed_columns(
    slots: SlotBatch,
    changed: np.ndarray,
    counts: np.ndarray,
    local: np.ndarray,
    old_bits: np.ndarray,
    new_bits: np.ndarray,
) -> tuple[Sequence[Slot], Sequence[str], codec.ChangeColumns]:
    """The changed slots (indices `changed` in the batch, `counts` changes each), their names
    and their changes as columns: slot-local positions and bits, in slot order."""
    info = _info(slots)
    found: Sequence[Slot]
    if changed.size == len(slots):
        found, names, dtypes = slots, info.names, info.dtypes
    else:
        rows = changed.tolist()
        found = [slots[i] for i in rows]
        names = [info.names[i] for i in rows]
        dtypes = [info.dtypes[i] for i in rows]
    return (
        found,
        names,
        codec.ChangeColumns.joined(dtypes, info.numel[changed], counts[changed], local, old_bits, new_bits),
    )


@functools.lru_cache(maxsize=256)
def _slot_starts(slots: SlotBatch, device: torch.device) -> torch.Tensor:
    """Each slot's first element, relative to the batch's, on `device` (cached: a run diffs
    the same batches again, and a copy from pageable memory would wait for the stream)."""
    first = slots[0].offset
    return torch.tensor([s.offset - first for s in slots], dtype=torch.int64, device=device)


def _ranges(old: ViewBuffer, new: ViewBuffer, slots: Sequence[Slot]) -> tuple[torch.Tensor, torch.Tensor]:
    """The word-aligned range of a batch's group buffers, old and new."""
    group = slots[0].group
    start, stop = slots[0].offset, word_aligned(slots[-1].offset + slots[-1].numel, group[1])
    return old.groups[group][start:stop], new.groups[group][start:stop]


def _begin_fused(old: ViewBuffer, new: ViewBuffer, slots: Sequence[Slot]) -> fused_diff.ChangedElements:
    """The fused pass of a batch, its first half queued (on the current stream)."""
    return fused_diff.ChangedElements(*_ranges(old, new, slots), key=as_batch(slots))


def _find(
    old: ViewBuffer,
    new: ViewBuffer,
    slots: Sequence[Slot],
    want_hints: bool,
    use_fused: bool,
    begun: fused_diff.ChangedElements | None = None,
    then: Callable[[], None] | None = None,
) -> Found:
    """`start_diff` on the device (see `Found`). With the fused pass, `begun` is this batch's
    pass if it was started already, and `then` runs once it is queued, before its counts
    are waited for (`iter_diffs` starts the next batch's pass there)."""
    batch = as_batch(slots)
    if use_fused:
        fused = begun or _begin_fused(old, new, slots)
        if then is not None:
            then()
        pos, old_changed, new_changed = fused.result()
    else:
        pos, old_changed, new_changed = _changed(*_ranges(old, new, slots))
    starts = _slot_starts(batch, pos.device)
    owner = torch.searchsorted(starts, pos, right=True) - 1
    device_local = pos - starts[owner]
    # each slot's first change (positions ascend): counts without a synchronising bincount
    copy = HostCopy(
        (torch.searchsorted(pos, starts), device_local.to(_index_dtype(batch)), old_changed, new_changed)
    )
    changed = pos.numel()

    def arrived() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Hints | None]:
        firsts, local, old_h, new_h = copy.wait()
        return local, np.diff(firsts, append=changed), old_h, new_h, None

    if not want_hints:
        return arrived
    local, counts, old_h, new_h, _ = arrived()
    ranks = (
        _hints(old, new, batch, counts, _Changed(owner, device_local, old_changed, new_changed))
        if changed
        else None
    )
    return lambda: (local, counts, old_h, new_h, ranks)


@dataclass(frozen=True)
class _Plans:
    """The slots of a batch whose classes pay off (indices in the batch, ascending), their
    thresholds (t_low, t_top) and their class limits as the rank passes test them (`_plans`),
    a row each."""

    picked: np.ndarray
    thresholds: np.ndarray
    limits: np.ndarray


Hints = tuple[_Plans, np.ndarray, int]
"""The planned slots; the ranks of the batch's changes (meaningful in the planned slots'
ranges); the bytes that crossed to the host for them."""


@dataclass(frozen=True)
class _BatchInfo:
    """What the diff's result and hints read of a batch's slots, made once per batch
    (`_info`): a model of many tensors would otherwise walk its slots in Python at every
    version."""

    names: list[str]  # per slot
    dtypes: list[str]  # per slot
    offsets: np.ndarray  # per slot: its first element, relative to the batch's
    numel: np.ndarray  # per slot
    floating: np.ndarray  # per slot: whether its dtype has an exponent (a hint)
    by_dtype: dict[str, np.ndarray]  # per floating dtype, its slots (indices, ascending)
    bins: int  # `fused_diff.hint_bins`


@functools.lru_cache(maxsize=256)
def _info(slots: SlotBatch) -> _BatchInfo:
    by_dtype: dict[str, list[int]] = {}
    for i, slot in enumerate(slots):
        if slot.dtype in codec.EXPONENT_FIELDS:
            by_dtype.setdefault(slot.dtype, []).append(i)
    floating = np.zeros(len(slots), dtype=bool)
    for rows in by_dtype.values():
        floating[rows] = True
    return _BatchInfo(
        [s.name for s in slots],
        [s.dtype for s in slots],
        np.array([s.offset - slots[0].offset for s in slots], dtype=np.int64),
        np.array([s.numel for s in slots], dtype=np.int64),
        floating,
        {dtype: np.array(rows, dtype=np.int64) for dtype, rows in by_dtype.items()},
        fused_diff.hint_bins(slots),
    )


def _rows(table: np.ndarray, rows: np.ndarray, bins: int) -> np.ndarray:
    """`table`'s first `bins` columns of `rows` (ascending, distinct): a view when they are
    all of its rows (the common batch: every tensor changed, one dtype), not a gather."""
    return table[:, :bins] if rows.size == table.shape[0] else table[rows, :bins]


def _plans(
    slots: SlotBatch, counts: np.ndarray, sampled: np.ndarray, changed: np.ndarray, top: int
) -> _Plans:
    """Step 3 of the contract in `codec.plan_thresholds`, for each changed floating slot whose
    exponent counts (rows of `sampled` and `changed`, at least as wide as its exponent range)
    make the classes pay off: one compiled call per dtype (`codec.plan_thresholds_many`).
    The limits are `codec.class_limits` as `magnitude <= limit - 1` tests them, clamped to
    `top`, the largest sign-less pattern, so that each fits the signed element type."""
    info = _info(slots)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for dtype, of_dtype in info.by_dtype.items():
        rows = of_dtype[counts[of_dtype] > 0]
        if rows.size == 0:
            continue
        bins = codec.EXPONENT_FIELDS[dtype][1] + 1
        found = codec.plan_thresholds_many(
            _rows(sampled, rows, bins), _rows(changed, rows, bins), info.numel[rows]
        )
        pays = found[:, 0] >= 0
        low, small = codec.class_limits(dtype, found[pays, 0], found[pays, 1])
        parts.append((rows[pays], found[pays], np.minimum(np.stack((low, small), axis=1) - 1, top)))
    if not parts:
        return _Plans(
            np.zeros(0, dtype=np.int64), np.zeros((0, 2), dtype=np.int64), np.zeros((0, 2), dtype=np.int64)
        )
    picked, thresholds, limits = (np.concatenate(column) for column in zip(*parts, strict=True))
    order = np.argsort(picked, kind="stable")
    return _Plans(picked[order], thresholds[order], limits[order])


@dataclass(frozen=True)
class _Changed:
    """A batch's changes on the device, in slot order: each one's slot (index in the batch),
    slot-local position, old and new bits."""

    owner: torch.Tensor
    local: torch.Tensor
    old_bits: torch.Tensor
    new_bits: torch.Tensor


def _hints(old: ViewBuffer, new: ViewBuffer, slots: SlotBatch, counts: np.ndarray, found: _Changed) -> Hints:
    """The context hints of a batch's changes, found by either pass, the sampled counts kept.

    Step 2 of the contract over the changes only, all the batch's slots at once: one
    `unique` (a sort: a histogram of concentrated exponents by atomics measured 12x slower
    on an H200) counts the changed elements' old exponents, and the sampled elements'
    exponents that the changes remove and add; one small copy brings the counts to the
    host. The sampled counts of the old tensors come from `old.sampled_counts` (counted
    here the first time, `_count_sampled`), moved by those changes into
    `new.sampled_counts` (`sampled_counts` says why). The host picks the thresholds exactly
    as the codec does; the ranks of the slots whose classes pay off come from the fused
    pass' rank kernels where Triton runs (the changed lanes scattered from the positions),
    else from cumulative counts per slot (`_class_ranks`).
    """
    device = found.local.device
    info = _info(slots)
    bins = info.bins
    n = len(slots) * bins
    present, times = torch.unique(_hint_keys(slots, bins, found), return_counts=True)
    present_h, times_h = to_host(present, times)
    counts_bytes = present_h.nbytes + times_h.nbytes
    if present_h.size and present_h[-1] == 3 * n:  # the Triton keys' mark of a key not counted
        present_h, times_h = present_h[:-1], times_h[:-1]
    # the keys ascend: the changed elements' old exponents, then the sampled elements'
    # exponents that the changes remove, then those they add (each range a [slot, bin] table)
    removed_at, added_at = np.searchsorted(present_h, (n, 2 * n)).tolist()
    changed = np.zeros((len(slots), bins), dtype=np.int64)
    changed.reshape(-1)[present_h[:removed_at]] = times_h[:removed_at]
    kept, moving = _sampled_counts(old), _sampled_counts(new)
    rows = kept.rows(slots)
    sampled = kept.table[rows, :bins]  # a view (the batch's rows are consecutive): written through
    unknown = np.flatnonzero(info.floating & (counts > 0) & (sampled[:, 0] < 0))
    if unknown.size:  # counted once: they describe the old bytes until `fill` replaces them
        counted, crossed = _count_sampled(old, slots, unknown, bins)
        sampled[unknown] = counted
        counts_bytes += crossed
    # the new buffer's counts: the old ones moved by the changes, in place
    moved = moving.table[rows]
    moved[:, bins:] = -1
    moved[:, :bins] = sampled
    # the moves by flat index into the rows (C-contiguous: a view), one fancy index each, not
    # a (row, column) pair: tens of thousands of keys a batch
    flat, width = moved.reshape(-1), moved.shape[1]
    for lo, hi, sign in ((removed_at, added_at, -1), (added_at, present_h.size, 1)):
        at = present_h[lo:hi] - (n if sign < 0 else 2 * n)
        if width != bins:
            at += at // bins * (width - bins)
        flat[at] += sign * times_h[lo:hi]
    moved[sampled[:, 0] < 0] = -1
    top = (1 << (8 * found.old_bits.element_size() - 1)) - 1
    plans = _plans(slots, counts, sampled, changed, top)
    if plans.picked.size == 0:
        return plans, np.empty(0, dtype=np.int64), counts_bytes
    rank_dtype = _index_dtype(slots)
    group = old.groups[slots[0].group]
    if fused_diff.available(device):
        lanes = fused_diff.lanes_at(slots, found.owner, found.local)
        ranks = fused_diff.class_ranks(
            group, slots, lanes, found.local.numel(), plans.picked, plans.limits, rank_dtype
        )
    else:
        bounds = np.concatenate(([0], np.cumsum(counts)))
        ranks = torch.zeros(found.local.numel(), dtype=rank_dtype, device=device)
        for i, (low, small) in zip(plans.picked.tolist(), plans.limits.tolist(), strict=True):
            lo, hi = bounds[i], bounds[i + 1]
            ranks[lo:hi] = _class_ranks(
                old.bits(slots[i]), found.local[lo:hi], found.old_bits[lo:hi], (low, small), rank_dtype
            )
    (host_ranks,) = to_host(ranks)
    return plans, host_ranks, counts_bytes + host_ranks.nbytes


def _hint_keys(slots: SlotBatch, bins: int, found: _Changed) -> torch.Tensor:
    """The keys `_hints` counts, each a [slot, bin] of one of three tables: the changed
    elements' old exponents (`slot * bins + exponent`), the sampled changed elements' old
    exponents (+ n) and their new ones (+ 2n), n = slots * bins. Where Triton runs, one
    launch writes all three for every change, `3n` where a change has none of a table
    (`fused_diff.hint_keys`) in place of the torch code's two dozen element-wise calls,
    each of which gives the GIL up and takes it back behind the publisher's other threads
    (design.md); the torch code is the reference and the CPU path."""
    stride, shift, keymask = fused_diff.key_tables(slots, found.local.device)
    if fused_diff.available(found.local.device):
        return fused_diff.hint_keys(
            found.owner, found.local, found.old_bits, found.new_bits, stride, shift, keymask, bins
        )
    st = stride[found.owner]
    floating = st > 0
    base = found.owner * bins
    old_keys = base + ((found.old_bits.to(torch.int64) >> shift[found.owner]) & keymask[found.owner])
    new_keys = base + ((found.new_bits.to(torch.int64) >> shift[found.owner]) & keymask[found.owner])
    sampled_changed = floating & ((found.local & (st - 1)) == 0)
    n = len(slots) * bins
    return torch.cat((old_keys[floating], old_keys[sampled_changed] + n, new_keys[sampled_changed] + 2 * n))


_tables_lock = threading.Lock()  # batches of one diff run in helper threads


def _sampled_counts(buffer: ViewBuffer) -> SampledCounts:
    with _tables_lock:
        if buffer.sampled_counts is None:
            buffer.sampled_counts = SampledCounts(buffer.layout)
        return buffer.sampled_counts


def _count_sampled(
    old: ViewBuffer, slots: SlotBatch, picked: np.ndarray, bins: int
) -> tuple[np.ndarray, int]:
    """The exponent counts of the sampled old elements of the slots `picked` (indices in the
    batch; step 2 of the contract), a row each, and the bytes that crossed to the host for
    them: the first time a tensor is hinted; then its counts are kept. Where Triton runs,
    one launch over their tiles (`fused_diff.sampled_counts`); else many slots' samples
    per `unique`, in chunks of at most `RANK_CHUNK_ELEMENTS`."""
    group = old.groups[slots[0].group]
    if fused_diff.available(group.device):
        (found,) = to_host(fused_diff.sampled_counts(group, slots, picked, bins))
        return found.astype(np.int64), found.nbytes
    out = np.zeros((len(picked), bins), dtype=np.int64)
    crossed = 0
    chunk: list[torch.Tensor] = []
    size = 0

    def flush() -> int:
        present, times = to_host(*torch.unique(torch.cat(chunk), return_counts=True))
        out.reshape(-1)[present] += times
        return present.nbytes + times.nbytes

    for row, i in enumerate(picked.tolist()):
        sample = old.bits(slots[i])[:: codec.sample_stride(slots[i].numel)]
        chunk.append(_exponent_keys(sample, slots[i].dtype, row * bins))
        size += sample.numel()
        if size >= RANK_CHUNK_ELEMENTS:
            crossed += flush()
            chunk, size = [], 0
    if chunk:
        crossed += flush()
    return out, crossed


def _diff_on_host(old: ViewBuffer, new: ViewBuffer, slots: Sequence[Slot]) -> BatchDiff:
    """The CPU path: the codec's compiled diff over the batch's range of the buffers, in
    place (one call for all its slots: the padding between them is zero in every buffer),
    its positions made local to their slots in one pass."""
    group = slots[0].group
    width = group[1]
    start, stop = slots[0].offset * width, word_aligned(slots[-1].offset + slots[-1].numel, width) * width
    found = codec.diff(old.host_group(group)[start:stop], new.host_group(group)[start:stop], slots[0].dtype)
    batch = as_batch(slots)
    offsets = _info(batch).offsets
    counts = np.diff(np.searchsorted(found.positions, offsets), append=found.count)
    local = found.positions - np.repeat(offsets, counts)
    changed_slots, names, columns = _changed_columns(
        batch, np.flatnonzero(counts), counts, local, found.old_bits, found.new_bits
    )
    return BatchDiff(
        changed_slots,
        names,
        columns,
        None,
        found.positions.nbytes + found.old_bits.nbytes + found.new_bits.nbytes,
    )


def batch_bytes_for(layout: ViewLayout) -> int:
    """Small batches on the CPU (the diff of one overlaps the encoding of the previous),
    large ones on CUDA (each batch costs a few synchronisations)."""
    on_cuda = any(device.startswith("cuda") for device, _ in layout.group_numel)
    return CUDA_BATCH_BYTES if on_cuda else CPU_BATCH_BYTES


def iter_diffs(
    old: ViewBuffer, new: ViewBuffer, hints: bool | None = None, fused: bool | None = None
) -> Generator[BatchDiff, None, None]:
    """The diff batch by batch (`start_diff`), the next batches started in helper threads
    while the caller encodes the current one (torch releases the GIL in its kernels).

    On CUDA without hints one helper runs up to `CUDA_AHEAD` batches ahead, all on one pass
    stream: it waits only for each batch's changed count (`nonzero`), never for a copy to
    the host, so the copies of earlier batches cross the bus while the next batches'
    kernels run (H200, 8 GB of 64 MiB tensors: diff 457-468 GB/s of view this way, 358-383
    with two batches in flight that each waited for its own copy); the fused pass there
    also queues the next batch's compare before it waits for a batch's counts
    (`fused_diff.ChangedElements`), so that the pass stream does not wait for the host.
    With hints a batch waits for its counts on the host in the middle of its pass, so two
    batches are diffed at once, each on a pass stream of its own (`CUDA_HINT_LANES`). On
    the CPU one helper runs one batch ahead, which is what the encoding overlaps.
    """
    todo = batches(new.layout, batch_bytes_for(new.layout))
    on_cuda = any(device.startswith("cuda") for device, _ in new.layout.group_numel)
    lanes = CUDA_HINT_LANES if on_cuda and device_hints(hints, "cuda") else 1
    ahead = CUDA_AHEAD if on_cuda else 1
    begun: dict[int, fused_diff.ChangedElements] = {}  # fused passes started a batch early

    def start(i: int) -> Finish:
        def begin_next() -> None:
            begun[i + 1] = _begin_fused(old, new, todo[i + 1])

        device = todo[i][0].group[0]
        chained = (
            bool(fused)
            and lanes == 1
            and not device_hints(hints, device)
            and i + 1 < len(todo)
            and todo[i + 1][0].group[0] == device
        )
        return start_diff(
            old, new, todo[i], hints, fused, i % lanes, begun.pop(i, None), begin_next if chained else None
        )

    with ThreadPoolExecutor(lanes, thread_name_prefix="deltaboard-diff") as pool:
        pending: deque[Future[Finish]] = deque()
        for i in range(len(todo)):
            pending.append(pool.submit(start, i))
            if len(pending) > ahead:
                yield pending.popleft().result()()
        while pending:
            yield pending.popleft().result()()


def diff_views(
    old: ViewBuffer, new: ViewBuffer, hints: bool | None = None, fused: bool | None = None
) -> ViewDiff:
    """Changes from `old` to `new`, two buffers of the same layout, in one result."""
    result = ViewDiff()
    for part in iter_diffs(old, new, hints, fused):
        result.changes.update(part.changes)
        result.hints.update(part.hints)
        result.host_bytes += part.host_bytes
        result.hint_bytes += part.hint_bytes
    return result
