"""In-place access to the tensors of a slot's safetensors shards, through mmap.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and `data_offsets`, then the raw bytes. The follower maps each shard
file once and hands out zero-copy `uint8` views of tensors: a patch writes only the
changed elements through the mapping (the kernel writes back the dirty pages), and the
codec reads the old bits it needs for context from the same mapping, so an update never
reads or rewrites a whole tensor.

Page faults, not bytes, are the cost of a sparse in-place write: ~1% of bf16 elements
changed is ~20 changes per 4 KiB page, so every page of a changed tensor is touched, first
by the codec's read of the old bits, then by the write. For a tensor that dense,
`prefault` asks the kernel to map the whole region writable in one call
(`MADV_POPULATE_WRITE`, Linux >= 5.14) instead of taking two faults per page.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deltaboard.board.codec import uint_dtype

HEADER_LEN = struct.Struct("<Q")
# A header larger than this is not a shard we wrote: refuse rather than allocate it.
MAX_HEADER = 100 * 2**20
MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module does not name it yet
# Prefault a tensor's pages when its changes average at least this many per page: then
# almost every page is written anyway (P(untouched) = e**-4 ~ 2%).
PREFAULT_PER_PAGE = 4


@dataclass(frozen=True)
class Placement:
    """Where a tensor's bytes live: `offset` is absolute within `file`."""

    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def read_placements(path: Path) -> dict[str, Placement]:
    """Parse one shard's header (without reading its data)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_LEN.size)
        if len(head) != HEADER_LEN.size:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (n,) = HEADER_LEN.unpack(head)
        if n > MAX_HEADER:
            raise ValueError(f"{path} declares a {n}-byte header")
        header = json.loads(f.read(n))
    start = HEADER_LEN.size + n
    header.pop("__metadata__", None)
    return {
        name: Placement(
            file=path.name,
            offset=start + info["data_offsets"][0],
            nbytes=info["data_offsets"][1] - info["data_offsets"][0],
            dtype=info["dtype"],
            shape=tuple(info["shape"]),
        )
        for name, info in header.items()
    }


class ShardMaps:
    """Memory maps of every shard of one slot, opened lazily, writable or read-only."""

    def __init__(self, slot_dir: Path, *, writable: bool) -> None:
        self.slot_dir = slot_dir
        self.writable = writable
        self.placements: dict[str, Placement] = {}
        for path in sorted(slot_dir.glob("*.safetensors")):
            self.placements.update(read_placements(path))
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def _map(self, file: str) -> tuple[mmap.mmap, np.ndarray]:
        mapped = self._maps.get(file)
        if mapped is None:
            with open(self.slot_dir / file, "r+b" if self.writable else "rb") as f:
                access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
                region = mmap.mmap(f.fileno(), 0, access=access)
            mapped = (region, np.frombuffer(region, dtype=np.uint8))
            self._maps[file] = mapped
        return mapped

    def tensor(self, name: str) -> np.ndarray:
        """The tensor's raw bytes, a view into the mapping (writes go to the file)."""
        p = self.placements[name]
        return self._map(p.file)[1][p.offset : p.offset + p.nbytes]

    def prefault(self, name: str, changes: int) -> None:
        """Map a tensor's pages writable in one call if `changes` touch nearly all of them
        (best effort: on older kernels the pages fault in one by one as before)."""
        p = self.placements[name]
        if not self.writable or changes < PREFAULT_PER_PAGE * (p.nbytes // mmap.PAGESIZE):
            return
        start = p.offset - p.offset % mmap.PAGESIZE
        with contextlib.suppress(OSError):
            self._map(p.file)[0].madvise(MADV_POPULATE_WRITE, start, p.offset + p.nbytes - start)

    def write_changes(self, name: str, positions: np.ndarray, new_bits: np.ndarray) -> None:
        """Store `new_bits` at element `positions`: only those bytes are touched."""
        p = self.placements[name]
        self.tensor(name).view(uint_dtype(p.dtype))[positions] = new_bits

    def close(self) -> None:
        self._maps.clear()
