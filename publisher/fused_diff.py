"""The diff of a batch of slots as a few Triton launches over the whole batch, not per tensor.

`device_diff` finds changes with torch (`ne`, `nonzero`, gathers: one synchronising kernel
chain per chunk, and the context hint's exponent counts and class ranks as further full
passes); here the same result comes from kernels that read each buffer once and write only
what changed, whatever the number of tensors:

1. `count`: per tile of `TILE` elements (a tile never straddles two slots, so its slot is
   one table lookup), compare old and new, store the tile's changed count and its changed
   lanes as a bitmask (1/16 of a bf16 tile's bytes); with hints, add the tile's sampled old
   exponents to its slot's histogram (`codec.plan_thresholds` step 2);
2. a scan of the tile counts (torch `cumsum`) gives each tile's place in the output;
3. `scatter`: per tile with changes, the bitmask's exclusive prefix sum places each changed
   lane; its slot-local position and old and new bits are gathered and stored, compacted
   and in ascending order; with hints, its old exponent goes to the slot's changed histogram;
4. with hints, once the host picked each slot's thresholds from the histograms
   (`codec.plan_thresholds`, called as the contract says), `class_counts` counts each
   tile's members of the two lower classes, a per-slot scan of those counts gives each
   tile's members before it, and `class_ranks` ranks the changed lanes of each tile.

The torch path in `device_diff` stays the reference (and the fallback where Triton is
missing): `tests/publisher/test_fused_diff.py` checks that both give the same positions,
bits, counts and ranks, under Triton's CPU interpreter (`TRITON_INTERPRET=1`) and on CUDA.
Triton is imported on first use only: the publisher runs without it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from deltaboard.board import codec
from deltaboard.publisher.snapshot import Slot

TILE = 4096  # elements per program; a multiple of 32 (one bitmask word per 32 lanes)
WARPS = 8  # warps per program: 8 beat 4 on the H200 at TILE 4096 (design.md)


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
    first tile (`first[-1]` the tile count), on the host."""

    start: torch.Tensor
    stop: torch.Tensor
    slot: torch.Tensor
    first: np.ndarray
    offset: torch.Tensor  # per slot: its first element in the group

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
    )


@dataclass
class FusedChanges:
    """What the fused pass found in a batch, on its device: slot-local positions and bits
    in slot order, each slot's changed count (host), and with hints the per-slot exponent
    histograms of the sampled old tensor and of the changed elements' old bits."""

    positions: torch.Tensor
    old_bits: torch.Tensor
    new_bits: torch.Tensor
    slot_counts: np.ndarray
    sampled: torch.Tensor | None
    changed: torch.Tensor | None
    tile_counts: torch.Tensor
    tile_offsets: torch.Tensor
    masks: torch.Tensor
    tile: int  # the elements per tile these tables were made with


def _key_tables(slots: Sequence[Slot], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per slot: sample stride (0 for a dtype without exponent: no hint; else a power of two,
    which the kernel tests with a mask, not a division), shift, key mask."""
    stride, shift, keymask = [], [], []
    for s in slots:
        field = codec.EXPONENT_FIELDS.get(s.dtype)
        stride.append(codec.sample_stride(s.numel) if field else 0)
        if stride[-1] & (stride[-1] - 1):
            raise ValueError(f"the codec's sample stride {stride[-1]} is not a power of two")
        shift.append(field[0] if field else 0)
        keymask.append(field[1] if field else 0)
    return tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in (stride, shift, keymask))


def hint_bins(slots: Sequence[Slot]) -> int:
    """Histogram bins per slot: the largest exponent range of the batch's floating slots
    (every range is a power of two)."""
    return max(
        (codec.EXPONENT_FIELDS[s.dtype][1] + 1 for s in slots if s.dtype in codec.EXPONENT_FIELDS), default=1
    )


def changes(old: torch.Tensor, new: torch.Tensor, slots: Sequence[Slot], hints: bool) -> FusedChanges:
    """Steps 1-3 of the module docstring over the group buffers `old` and `new`."""
    k = _kernels()
    device = old.device
    table = tiles(tuple(slots), str(device), TILE)
    n = table.count
    counts = torch.empty(n, dtype=torch.int32, device=device)
    masks = torch.empty(max(n, 1) * (TILE // 32), dtype=torch.int32, device=device)
    stride, shift, keymask = _key_tables(slots, device)
    bins = hint_bins(slots)
    sampled = changed = None
    if hints:
        sampled = torch.zeros((len(slots), bins), dtype=torch.int32, device=device)
        changed = torch.zeros((len(slots), bins), dtype=torch.int32, device=device)
    dummy = counts  # stands in for the histograms when there are none (never written)
    if n:
        k.count[(n,)](
            old, new, table.start, table.stop, table.slot, counts, masks,
            table.offset, stride, shift, keymask, sampled if hints else dummy,
            HIST=hints, BINS=bins, TILE=TILE, num_warps=WARPS,
        )  # fmt: skip
    ends = torch.cumsum(counts, 0)
    offsets = ends - counts
    per_slot = torch.zeros(len(slots), dtype=torch.int64, device=device)
    if n:
        per_slot.index_add_(0, table.slot.to(torch.int64), counts.to(torch.int64))
    slot_counts = per_slot.cpu().numpy()  # the one synchronisation: sizes the output
    total = int(slot_counts.sum())
    positions = torch.empty(total, dtype=torch.int64, device=device)
    old_bits = torch.empty(total, dtype=old.dtype, device=device)
    new_bits = torch.empty(total, dtype=old.dtype, device=device)
    if total:
        k.scatter[(n,)](
            old, new, table.start, table.slot, counts, offsets, masks, table.offset,
            positions, old_bits, new_bits, shift, keymask, stride, changed if hints else dummy,
            HIST=hints, BINS=bins, TILE=TILE, num_warps=WARPS,
        )  # fmt: skip
    return FusedChanges(
        positions, old_bits, new_bits, slot_counts, sampled, changed, counts, offsets, masks, TILE
    )


def class_ranks(
    old: torch.Tensor,
    slots: Sequence[Slot],
    found: FusedChanges,
    plans: dict[int, tuple[int, int]],
    rank_dtype: torch.dtype,
) -> torch.Tensor:
    """Step 4 of the module docstring: the rank of every changed element of the slots in
    `plans` (slot index: class limits, each `min(limit - 1, largest sign-less pattern)`),
    aligned with `found.positions` (other slots' entries are left unset)."""
    k = _kernels()
    device = old.device
    table = tiles(tuple(slots), str(device), found.tile)
    picked = np.concatenate(
        [np.arange(table.first[s], table.first[s + 1]) for s in sorted(plans)] or [np.zeros(0, np.int64)]
    )
    ranks = torch.empty(found.positions.numel(), dtype=rank_dtype, device=device)
    if picked.size == 0:
        return ranks
    table_of_limits = np.zeros((len(slots), 2), dtype=np.int64)
    for s, pair in plans.items():
        table_of_limits[s] = pair
    limits = torch.from_numpy(table_of_limits).to(device)
    chosen = torch.from_numpy(picked).to(device)
    top = (1 << (8 * old.element_size() - 1)) - 1
    members = torch.empty((picked.size, 2), dtype=torch.int64, device=device)
    k.class_counts[(picked.size,)](
        old,
        chosen,
        table.start,
        table.stop,
        table.slot,
        limits,
        members,
        TOP=top,
        TILE=found.tile,
        num_warps=WARPS,
    )
    # members of each tile's slot in the tiles before it: a scan restarted at every slot
    ends = torch.cumsum(members, 0)
    slot_of = table.slot[chosen].to(torch.int64)
    first_of_slot = torch.ones(picked.size, dtype=torch.bool, device=device)
    first_of_slot[1:] = slot_of[1:] != slot_of[:-1]
    restart = torch.cummax(torch.where(first_of_slot, torch.arange(picked.size, device=device), 0), 0).values
    before = ends - members - (ends - members)[restart]
    k.class_ranks[(picked.size,)](
        old, chosen, table.start, table.stop, table.slot, found.tile_counts, found.tile_offsets, found.masks,
        table.offset, limits, before.contiguous(), ranks, TOP=top, TILE=found.tile, num_warps=WARPS,
    )  # fmt: skip
    return ranks
