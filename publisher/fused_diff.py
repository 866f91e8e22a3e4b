"""The diff of a batch of slots as a few Triton launches over the whole batch, not per tensor.

`device_diff` finds changes with torch (`ne`, `nonzero`, gathers: one synchronising kernel
chain per chunk); here the same result comes from kernels that read each buffer once and
write only what changed, whatever the number of tensors:

1. one read of both buffers, in tiles of 64-bit words (`compact_words`): each tile
   compares old and new, claims its range of the output with one atomic add on a cursor
   (tiles claim in whatever order they run), and stores its changed words there in
   ascending order (an exclusive prefix sum of the changed counts): index, old, new. The
   output is sized before the count is known (`_capacity`); a pass that finds more runs
   once more;
2. a scan of the tile counts (torch `cumsum`) gives each tile's place in order, and
   `reorder` moves every tile's run there: only the changes are read and written again;
   `lane_counts` and `split_words` then split the changed words into their changed
   elements (`ChangedElements`, in two halves around the read of the counts).

The context hint's kernels work on element tiles that never straddle two slots (`tiles`),
for either pass' changes (`device_diff` computes the hint's counts over the changes):
`sampled_counts` counts a tensor's sampled old exponents the first time it is hinted;
once the host picked each slot's thresholds (`codec.plan_thresholds`, called as the
contract says), `class_counts` counts each tile's members of the two lower classes, a
per-slot scan of those counts gives each tile's members before it, and `class_ranks`
ranks the changed lanes of each tile (`lanes_at` scatters them from the positions).

The torch path in `device_diff` stays the reference (and the fallback where Triton is
missing): `tests/publisher/test_fused_diff.py` checks that both give the same positions,
bits, counts and ranks, under Triton's CPU interpreter (`TRITON_INTERPRET=1`) and on CUDA.
Triton is imported on first use only: the publisher runs without it.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from deltaboard.board import codec
from deltaboard.publisher.snapshot import Slot, as_batch

TILE = 4096  # elements per program; a multiple of 32 (one bitmask word per 32 lanes)
WARPS = 8  # warps per program: 8 beat 4 on the H200 at TILE 4096 (design.md)
KEY_BLOCK = 1024  # changes a `hint_keys` or `changed_lanes` program takes
REORDER_STEP = 128  # entries a `reorder` program moves per step (a tile holds ~TILE/100)


@functools.cache
def _triton() -> ModuleType | None:
    try:
        return importlib.import_module("triton")
    except ImportError:
        return None


def available(device: torch.device | str) -> bool:
    """Whether the fused kernels run by default on `device`: CUDA, with Triton installed.
    (On CPU tensors they run only when asked for, under Triton's interpreter: the tests.)"""
    return torch.device(device).type == "cuda" and _triton() is not None


def _kernels() -> ModuleType:
    """The jitted kernels (`fused_kernels`), imported once Triton is known to be there."""
    from deltaboard.publisher import fused_kernels

    return fused_kernels


@dataclass(frozen=True)
class Tiles:
    """A batch's tile table on its device: tile t covers group elements
    [start[t], stop[t]) of slot `slot[t]` (an index into the batch); `first[s]` is slot s's
    first tile (`first[-1]` the tile count), on the host, and `first_tile` the same but the
    count on the device."""

    start: torch.Tensor
    stop: torch.Tensor
    slot: torch.Tensor
    first: np.ndarray
    offset: torch.Tensor  # per slot: its first element in the group
    first_tile: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.first[-1])


@functools.lru_cache(maxsize=64)
def tiles(slots: tuple[Slot, ...], device: str, tile: int) -> Tiles:
    """The tile table of consecutive `slots`, `tile` elements a tile (cached: a run diffs
    the same batches again)."""
    offsets = np.array([s.offset for s in slots], dtype=np.int64)
    numel = np.array([s.numel for s in slots], dtype=np.int64)
    per_slot = -(-numel // tile)
    first = np.concatenate(([0], np.cumsum(per_slot)))
    slot = np.repeat(np.arange(len(slots), dtype=np.int32), per_slot)
    start = offsets[slot] + (np.arange(first[-1], dtype=np.int64) - first[:-1][slot]) * tile
    stop = np.minimum(start + tile, (offsets + numel)[slot])
    on = torch.device(device)
    return Tiles(
        torch.from_numpy(start).to(on),
        torch.from_numpy(stop).to(on),
        torch.from_numpy(slot).to(on),
        first,
        torch.from_numpy(offsets).to(on),
        torch.from_numpy(first[:-1].copy()).to(on),
    )


@dataclass(frozen=True)
class ChangedLanes:
    """Which elements of each tile of a batch's tile table changed (a bit per element,
    `masks`), how many (`tile_counts`) and where each tile's run starts in the batch's
    change arrays (`tile_offsets`): what `class_ranks` reads besides the old buffer."""

    tile_counts: torch.Tensor
    tile_offsets: torch.Tensor
    masks: torch.Tensor
    tile: int  # the elements per tile these tables were made with


def lanes_at(slots: Sequence[Slot], owner: torch.Tensor, local: torch.Tensor) -> ChangedLanes:
    """The `ChangedLanes` of changes found by another pass (the torch one): each change's
    slot (index in the batch) and slot-local position, in slot order, positions ascending.
    Two scatters over the changes, none over the tensors: a word's changed lanes are
    distinct bits, so adding them up is their OR. Where Triton runs, both in one launch
    (`changed_lanes`, by atomics): a dozen torch calls each gave the GIL up and took it
    back behind the publisher's other threads (design.md)."""
    device = local.device
    table = tiles(as_batch(slots), str(device), TILE)
    count = table.count
    masks = torch.zeros(max(count, 1) * (TILE // 32), dtype=torch.int32, device=device)
    counts = torch.zeros(count, dtype=torch.int32, device=device)
    if available(device):
        if local.numel():
            _kernels().changed_lanes[(-(-local.numel() // KEY_BLOCK),)](
                owner, local, table.first_tile, masks, counts, local.numel(), TILE=TILE, BLOCK=KEY_BLOCK
            )
    else:
        tile_of = table.first_tile[owner] + torch.div(local, TILE, rounding_mode="floor")
        lane = local % TILE
        # bit 31 wraps to the sign bit of an int32, as the fused pass stores it
        bits = torch.bitwise_left_shift(torch.ones_like(lane), lane % 32).to(torch.int32)
        masks.index_add_(0, tile_of * (TILE // 32) + torch.div(lane, 32, rounding_mode="floor"), bits)
        counts.index_add_(0, tile_of, torch.ones_like(tile_of, dtype=torch.int32))
    return ChangedLanes(counts, torch.cumsum(counts, 0) - counts, masks, TILE)


@functools.lru_cache(maxsize=64)
def key_tables(slots: tuple[Slot, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per slot: sample stride (0 for a dtype without exponent: no hint; else a power of two,
    which the kernel tests with a mask, not a division), shift, key mask (cached: a run
    diffs the same batches again, and a model of many tensors would build them per tensor)."""
    stride, shift, keymask = [], [], []
    for s in slots:
        field = codec.EXPONENT_FIELDS.get(s.dtype)
        stride.append(codec.sample_stride(s.numel) if field else 0)
        if stride[-1] & (stride[-1] - 1):
            raise ValueError(f"the codec's sample stride {stride[-1]} is not a power of two")
        shift.append(field[0] if field else 0)
        keymask.append(field[1] if field else 0)
    return tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in (stride, shift, keymask))


def hint_keys(
    owner: torch.Tensor,
    local: torch.Tensor,
    old_bits: torch.Tensor,
    new_bits: torch.Tensor,
    stride: torch.Tensor,
    shift: torch.Tensor,
    keymask: torch.Tensor,
    bins: int,
) -> torch.Tensor:
    """`device_diff._hint_keys` in one launch: for each of a batch's changes (its slot,
    slot-local position, old and new bits; the slots' `key_tables`), its key in each of
    the three tables, or `3 * slots * bins` where it has none (not floating; not sampled)."""
    changes = local.numel()
    keys = torch.empty(3 * changes, dtype=torch.int64, device=local.device)
    if changes:
        _kernels().hint_keys[(-(-changes // KEY_BLOCK),)](
            owner, local, old_bits, new_bits, stride, shift, keymask, keys,
            changes, stride.numel() * bins, bins, BLOCK=KEY_BLOCK,
        )  # fmt: skip
    return keys


def hint_bins(slots: Sequence[Slot]) -> int:
    """Histogram bins per slot: the largest exponent range of the batch's floating slots
    (every range is a power of two)."""
    return max(
        (codec.EXPONENT_FIELDS[s.dtype][1] + 1 for s in slots if s.dtype in codec.EXPONENT_FIELDS), default=1
    )


# per range diffed: the changed count its last pass found. The keys name batches, which
# are equal only to themselves (`SlotBatch`): those of a layout no longer diffed go, oldest
# first, past `_EXPECTED_KEYS`, rather than stay for the process' life.
_expected: dict[object, int] = {}
_EXPECTED_KEYS = 4096
_expected_lock = threading.Lock()  # the diff's lanes finish passes in threads of their own


def _remember(key: object, total: int) -> None:
    with _expected_lock:
        _expected.pop(key, None)
        _expected[key] = total
        if len(_expected) > _EXPECTED_KEYS:
            del _expected[next(iter(_expected))]


def _capacity(key: object, first_guess: int) -> int:
    """A pass' output size, chosen before its count is known: a quarter more than the last
    pass over `key` found (the changed fraction drifts slowly between versions), or
    `first_guess` the first time. A pass that finds more runs once again, sized exactly."""
    last = _expected.get(key)
    return max(1024, last + last // 4 if last is not None else first_guess)


class _OnItsWay:
    """Device scalars on their way to the host behind the kernels that write them. On CUDA
    they go to pinned memory with an event, so that the pass stream can take the next
    batch's kernels before the host reads them: a `.tolist()` queued on that stream would
    wait for those kernels too. A read waits in the copy engine behind the copies already
    queued (design.md), so a caller reads one of these once, for all its scalars."""

    def __init__(self, values: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        self._host = values
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._ready.record()

    def read(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        values: list[int] = self._host.tolist()
        return values


@dataclass(frozen=True)
class _Claimed:
    """The first half of a word pass with room for `capacity` changed words: the changed
    words (index, old, new) in tile order, the inclusive scan of their changed lanes, and
    both counts (changed words, changed elements) on their way to the host."""

    capacity: int
    words: list[torch.Tensor]
    ends: torch.Tensor
    counts: _OnItsWay


def _reordered(
    size: int, counts: torch.Tensor, offsets: torch.Tensor, bases: torch.Tensor, claimed: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Each tile's run moved from where it claimed it (`bases`) to its place in tile order
    (`offsets`, the exclusive scan of `counts`), into arrays of `size` entries: the count
    found, or the claimed capacity before the count is read (runs past it are not moved)."""
    out = [torch.empty(size, dtype=t.dtype, device=t.device) for t in claimed]
    if size and counts.numel():
        _kernels().reorder[(counts.numel(),)](counts, bases, offsets, size, *claimed, *out, STEP=REORDER_STEP)
    return out


WORD_TILE = 1024  # 64-bit words per `compact_words` program
SPLIT_BLOCK = 1024  # changed words per `lane_counts` / `split_words` program


class ChangedElements:
    """The pass without hints over one word-aligned range of a group's buffers: positions
    (from the range's start) of the elements whose bits differ, ascending, with their old
    and new bits, as `device_diff._changed` gives them; `key` names the range for the
    output's sizing (`_capacity`).

    Tiles compare whole 64-bit words and write the changed words (index, old, new) at the
    range they claim (`compact_words`, one read of both buffers), `reorder` puts them in
    order, then the changed words alone are split into their changed elements: a count
    per word, its scan, and a write at each word's place (`lane_counts`, `split_words`).
    An H200 measured the word pass at 0.77 ms per GB where per-element work in every
    tile had cost 1.4-2.8 (design.md).

    In two halves: making one queues everything up to the counts (the reorder and the lane
    counts run on the claimed capacity) and starts the counts to the host; `result()` reads
    them (one synchronisation) and queues the split. A caller diffing batch after batch
    makes the next batch's pass before it asks for this one's result
    (`device_diff.iter_diffs`), so the GPU compares the next batch while the host waits
    for these counts and queues this split: an H200 trace of one batch at a time showed
    the pass stream idle ~0.6 ms of every 1.65 ms batch, waiting for the host.
    """

    def __init__(self, old: torch.Tensor, new: torch.Tensor, key: object) -> None:
        self._old, self._new = old.view(torch.int64), new.view(torch.int64)
        self._dtype = old.dtype
        self._bits = 8 * old.element_size()
        self._key = ("words", key)
        self._tiles = -(-self._old.numel() // WORD_TILE)
        self._tile_counts = torch.zeros(self._tiles, dtype=torch.int32, device=old.device)
        self._bases = torch.empty(self._tiles, dtype=torch.int64, device=old.device)
        self._claimed = self._claim(_capacity(self._key, old.numel() // 64))

    def _claim(self, capacity: int) -> _Claimed:
        k = _kernels()
        device = self._old.device
        cursor = torch.zeros(1, dtype=torch.int64, device=device)
        claimed = [torch.empty(capacity, dtype=torch.int64, device=device) for _ in range(3)]
        if self._tiles:
            k.compact_words[(self._tiles,)](
                self._old, self._new, self._old.numel(), self._tile_counts, self._bases, cursor, capacity,
                *claimed, TILE=WORD_TILE, num_warps=WARPS,
            )  # fmt: skip
        offsets = torch.cumsum(self._tile_counts, 0) - self._tile_counts
        words = _reordered(capacity, self._tile_counts, offsets, self._bases, claimed)
        lanes = torch.empty(capacity, dtype=torch.int64, device=device)
        k.lane_counts[(-(-capacity // SPLIT_BLOCK),)](
            words[1], words[2], cursor, capacity, lanes,
            PER=64 // self._bits, BITS=self._bits, BLOCK=SPLIT_BLOCK, num_warps=4,
        )  # fmt: skip
        ends = torch.cumsum(lanes, 0)
        return _Claimed(capacity, words, ends, _OnItsWay(torch.cat((cursor, ends[-1:]))))

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        claimed = self._claimed
        while True:
            total, found = claimed.counts.read()
            _remember(self._key, total)
            if total <= claimed.capacity:
                break
            claimed = self._claim(total)
        device = self._old.device
        out = [torch.empty(found, dtype=d, device=device) for d in (torch.int64, self._dtype, self._dtype)]
        if total:
            _kernels().split_words[(-(-total // SPLIT_BLOCK),)](
                *claimed.words, claimed.ends, total, *out,
                PER=64 // self._bits, BITS=self._bits, BLOCK=SPLIT_BLOCK, num_warps=4,
            )  # fmt: skip
        return out[0], out[1], out[2]


def _tiles_of(table: Tiles, picked: np.ndarray) -> np.ndarray:
    """The tiles of the slots `picked` (indices in the batch, ascending), in order: each
    slot's run of tiles, laid end to end without a call per slot."""
    first = table.first[picked]
    sizes = table.first[picked + 1] - first
    return np.repeat(first - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(sizes.sum()))


def sampled_counts(old: torch.Tensor, slots: Sequence[Slot], picked: np.ndarray, bins: int) -> torch.Tensor:
    """Step 2 of the planning contract's sampled counts for the floating slots `picked`
    (indices in the batch, ascending), a row each on the device, in one launch over their
    tiles: what the device diff counts the first time it hints a tensor (then it keeps
    them), which a model of thousands of small tensors would otherwise pay in launches
    per tensor."""
    k = _kernels()
    device = old.device
    key = as_batch(slots)
    table = tiles(key, str(device), TILE)
    chosen = _tiles_of(table, picked)
    out = torch.zeros((len(picked), bins), dtype=torch.int32, device=device)
    if chosen.size == 0:
        return out
    rows = np.zeros(len(slots), dtype=np.int64)
    rows[picked] = np.arange(len(picked))
    stride, shift, keymask = key_tables(key, device)
    k.sampled_counts[(chosen.size,)](
        old, torch.from_numpy(chosen).to(device), table.start, table.stop, table.slot, table.offset,
        stride, shift, keymask, torch.from_numpy(rows).to(device), out, BINS=bins, TILE=TILE, num_warps=WARPS,
    )  # fmt: skip
    return out


def class_ranks(
    old: torch.Tensor,
    slots: Sequence[Slot],
    lanes: ChangedLanes,
    changed: int,
    planned: np.ndarray,
    limits: np.ndarray,
    rank_dtype: torch.dtype,
) -> torch.Tensor:
    """Step 3 of the module docstring: the rank of every changed element of the slots
    `planned` (indices in the batch, ascending; `limits` a row each: the class limits, each
    `min(limit - 1, largest sign-less pattern)`), aligned with the batch's `changed`
    changes (other slots' entries are left unset)."""
    k = _kernels()
    device = old.device
    table = tiles(as_batch(slots), str(device), lanes.tile)
    picked = _tiles_of(table, planned)
    ranks = torch.empty(changed, dtype=rank_dtype, device=device)
    if picked.size == 0:
        return ranks
    table_of_limits = np.zeros((len(slots), 2), dtype=np.int64)
    table_of_limits[planned] = limits
    on_device = torch.from_numpy(table_of_limits).to(device)
    chosen = torch.from_numpy(picked).to(device)
    top = (1 << (8 * old.element_size() - 1)) - 1
    members = torch.empty((picked.size, 2), dtype=torch.int64, device=device)
    k.class_counts[(picked.size,)](
        old,
        chosen,
        table.start,
        table.stop,
        table.slot,
        on_device,
        members,
        TOP=top,
        TILE=lanes.tile,
        num_warps=WARPS,
    )
    # members of each tile's slot in the tiles before it: a scan restarted at every slot,
    # each column scanned contiguous (torch scans a [tiles, 2] tensor down its rows with
    # one thread per column: 18 ms a batch on an H200, most of a hinted diff)
    ends = torch.cumsum(members.t().contiguous(), 1).t()
    slot_of = table.slot[chosen].to(torch.int64)
    first_of_slot = torch.ones(picked.size, dtype=torch.bool, device=device)
    first_of_slot[1:] = slot_of[1:] != slot_of[:-1]
    restart = torch.cummax(torch.where(first_of_slot, torch.arange(picked.size, device=device), 0), 0).values
    before = ends - members - (ends - members)[restart]
    k.class_ranks[(picked.size,)](
        old, chosen, table.start, table.stop, table.slot, lanes.tile_counts, lanes.tile_offsets, lanes.masks,
        table.offset, on_device, before.contiguous(), ranks, TOP=top, TILE=lanes.tile, num_warps=WARPS,
    )  # fmt: skip
    return ranks
