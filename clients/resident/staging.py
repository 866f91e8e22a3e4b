"""Staging: a width group's checked addresses and bits, put where the commit reads them.

One loop serves both devices (`stage_group`). The group is cut into chunks of at most
`chunk_bytes` of staged data; for each chunk one compiled pass over the host arrays
(`scatter.address`) checks every position (inside its tensor, increasing within it) and
writes its absolute address into the chunk's slot, which is then sent where the commit
reads it:

- `HostStaging`, for a CPU view: the slots are slices of the staged address array itself
  and sending is nothing; the bits stay in the patch's own arrays.
- `DeviceStaging`, for a CUDA view: two slots of pinned host memory, reused from chunk to
  chunk and version to version, so the copies to the device run at the link's speed
  without a pinned allocation per version (cudaHostAlloc of a fresh buffer costs more than
  it saves) and without the driver's own bounce through pageable memory. The pass also
  copies the chunk's old and new bits into the slot. Each slot's copy runs on a copy
  stream of its own while the host fills the other slot: checking chunk k+1 overlaps
  sending chunk k, and the only wait is for the last chunk. No synchronisation per
  tensor or per chunk beyond a slot's reuse.

Memory: a CUDA view holds `2 x chunk_bytes` of pinned host memory for its lifetime, and
the staged arrays on the device (changed elements x (8 + 2 x width) bytes per version).
A CPU view allocates the addresses (8 bytes per changed element) per version.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from deltaboard.clients.resident import scatter
from deltaboard.clients.resident.errors import ResidentError
from deltaboard.clients.resident.patch import WidthGroup

DEFAULT_CHUNK_BYTES = 16 * 2**20
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Slot = tuple[np.ndarray, np.ndarray, np.ndarray]  # addresses, old bits, new bits


class Staging(Protocol):
    """Where a view's staged arrays live; `stage_group` drives it chunk by chunk."""

    chunk_bytes: int
    wide: bool  # the pass on `scatter.WIDE_THREADS` threads: the host's cores are free

    def open(self, group: WidthGroup, old: np.ndarray, new: np.ndarray) -> None:
        """Begin staging `group` (its bits `old`, `new`, contiguous)."""

    def slot(self, start: int, count: int) -> Slot:
        """Host arrays for elements [start, start + count), to be filled by the pass; bit
        arrays are empty when the bits need no copy."""

    def send(self, start: int, count: int) -> None:
        """The slot of [start, start + count) is filled: move it where the commit reads it."""

    def finish(self) -> tuple[Any, Any, Any]:
        """Every chunk sent: the staged addresses, old bits, new bits, ready for the commit."""

    def abort(self) -> None:
        """Stop after a failed chunk: nothing in flight reads the slots afterwards."""


def stage_group(group: WidthGroup, ptrs: np.ndarray, staging: Staging) -> tuple[Any, Any, Any]:
    """Check and stage every element of `group` (tensor i at address `ptrs[i]`)."""
    n, width = group.changed, group.width
    positions = np.ascontiguousarray(group.positions)
    old, new = np.ascontiguousarray(group.old_bits), np.ascontiguousarray(group.new_bits)
    ends = np.cumsum(group.counts)
    step = max(1, staging.chunk_bytes // (8 + 2 * width))
    staging.open(group, old, new)
    try:
        for start in range(0, n, step):
            count = min(step, n - start)
            stop, slot = start + count, staging.slot(start, count)
            bad = scatter.address(
                positions, ends, group.numels, ptrs, width, start, stop, slot, (old, new), staging.wide
            )
            if bad >= 0:
                tensor = int(np.searchsorted(ends, bad, side="right"))
                inside = 0 <= positions[bad] < group.numels[tensor]
                raise ResidentError(
                    f"position {int(positions[bad])} of the width-{width} patch "
                    f"{'does not increase in' if inside else 'lies outside'} tensor {group.names[tensor]!r}"
                )
            staging.send(start, count)
    except BaseException:
        staging.abort()
        raise
    return staging.finish()


class HostStaging:
    """A CPU view's staging: the addresses in one array, the bits left where they are."""

    wide = False  # a CPU engine computes on these cores

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._staged: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._no_bits = np.empty(0, dtype=np.uint8)

    def open(self, group: WidthGroup, old: np.ndarray, new: np.ndarray) -> None:
        self._staged = (np.empty(group.changed, dtype=np.int64), old, new)
        self._no_bits = old[:0]

    def slot(self, start: int, count: int) -> Slot:
        assert self._staged is not None
        return self._staged[0][start : start + count], self._no_bits, self._no_bits

    def send(self, start: int, count: int) -> None:
        """The slot is the staged array: nothing to move."""

    def finish(self) -> tuple[Any, Any, Any]:
        staged, self._staged = self._staged, None
        assert staged is not None
        return staged

    def abort(self) -> None:
        self._staged = None


class DeviceStaging:
    """A CUDA view's staging: two pinned slots, a copy stream, the arrays on the device."""

    wide = True  # the engine computes on the GPU

    def __init__(self, device: torch.device, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._slots = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._sent: list[torch.cuda.Event | None] = [None, None]
        self._next = 0  # which slot the next chunk fills
        self._filling: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._staged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._bits: Any = np.uint8

    def open(self, group: WidthGroup, old: np.ndarray, new: np.ndarray) -> None:
        ints, n = _INTS[group.width], group.changed
        self._bits = old.dtype
        self._staged = (
            torch.empty(n, dtype=torch.int64, device=self.device),
            torch.empty(n, dtype=ints, device=self.device),
            torch.empty(n, dtype=ints, device=self.device),
        )
        # the copies must not overtake work still queued on memory the allocator handed out
        self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def slot(self, start: int, count: int) -> Slot:
        assert self._staged is not None
        index = self._next
        self._next ^= 1
        sent = self._sent[index]
        if sent is not None:
            sent.synchronize()  # the copy that last read this slot is done
        raw, width = self._slots[index], self._staged[1].element_size()
        addrs = raw[: 8 * count].view(torch.int64)
        old = raw[8 * count : (8 + width) * count].view(_INTS[width])
        new = raw[(8 + width) * count : (8 + 2 * width) * count].view(_INTS[width])
        self._filling = (index, addrs, old, new)
        return addrs.numpy(), old.numpy().view(self._bits), new.numpy().view(self._bits)

    def send(self, start: int, count: int) -> None:
        assert self._staged is not None and self._filling is not None
        index, *parts = self._filling
        with torch.cuda.stream(self._stream):
            for target, part in zip(self._staged, parts, strict=True):
                target[start : start + count].copy_(part, non_blocking=True)
            sent = torch.cuda.Event()  # type: ignore[no-untyped-call]
            sent.record(self._stream)
        self._sent[index] = sent

    def finish(self) -> tuple[Any, Any, Any]:
        self._stream.synchronize()  # staged means on the device: none of it in the pause
        staged, self._staged = self._staged, None
        assert staged is not None
        return staged

    def abort(self) -> None:
        self._stream.synchronize()
        self._staged = None
