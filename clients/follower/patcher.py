"""In-place access to the tensors of a slot's safetensors shards, through mmap.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and `data_offsets`, then the raw bytes. The follower maps each shard
file once and hands out zero-copy `uint8` views of tensors: a patch writes only the
changed elements through the mapping (the kernel writes back the dirty pages), and the
codec reads the old bits it needs for context from the same mapping, so an update never
reads or rewrites a whole tensor.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from board.codec import uint_dtype

HEADER_LEN = struct.Struct("<Q")
# A header larger than this is not a shard we wrote: refuse rather than allocate it.
MAX_HEADER = 100 * 2**20


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
        self._maps: dict[str, np.memmap] = {}

    def _map(self, file: str) -> np.memmap:
        mapped = self._maps.get(file)
        if mapped is None:
            mapped = np.memmap(self.slot_dir / file, dtype=np.uint8, mode="r+" if self.writable else "r")
            self._maps[file] = mapped
        return mapped

    def tensor(self, name: str) -> np.ndarray:
        """The tensor's raw bytes, a view into the mapping (writes go to the file)."""
        p = self.placements[name]
        return self._map(p.file)[p.offset : p.offset + p.nbytes]

    def write_changes(self, name: str, positions: np.ndarray, new_bits: np.ndarray) -> None:
        """Store `new_bits` at element `positions`: only those bytes are touched."""
        p = self.placements[name]
        self.tensor(name).view(uint_dtype(p.dtype))[positions] = new_bits

    def close(self) -> None:
        self._maps.clear()
