"""What changed between two versions of a tensor: positions and bit patterns.

`Changes` is the codec's common currency: `diff` produces it from two byte arrays on the
host, the publisher's device path produces the same thing on the tensors' own device, the
encoder codes it and `decode` gives it back to in-place writers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltaboard.board.codec.dtypes import as_bits, uint_dtype
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import differ_mask, kernel, trailing_zeros
from deltaboard.board.codec.parallel import map_ranges

_PARALLEL_MIN_WORDS = 1 << 14  # split tensors of a million elements and more
_Found = tuple[np.ndarray, np.ndarray, np.ndarray]  # positions, old bits, new bits


@dataclass(frozen=True)
class Changes:
    """Elements whose bits differ. `positions` is int64 (or int32, as the publisher's GPU
    diff hands them to the batch encoder, which widens them), strictly increasing, < numel;
    `old_bits`/`new_bits` are the element-width unsigned bit patterns at those positions."""

    dtype: str
    numel: int
    positions: np.ndarray
    old_bits: np.ndarray
    new_bits: np.ndarray

    @property
    def count(self) -> int:
        return int(self.positions.size)

    def validate(self) -> None:
        """Raise PatchError unless the arrays are consistent (used on untrusted input)."""
        n = self.positions.size
        if self.old_bits.shape != (n,) or self.new_bits.shape != (n,):
            raise PatchError("changes: positions, old_bits and new_bits differ in length")
        status = check_positions(self.positions, self.numel)
        if status == 1:
            raise PatchError("changes: a position lies outside the tensor")
        if status == 2:
            raise PatchError("changes: positions are not strictly increasing")


@kernel
def check_positions(positions: np.ndarray, numel: int) -> int:
    """0, or 1 if the first or last position lies outside [0, numel), else 2 if the
    positions do not strictly increase (one compiled pass: it runs on every patch)."""
    n = positions.size
    if n and (positions[0] < 0 or positions[n - 1] >= numel):
        return 1
    for i in range(1, n):
        if positions[i] <= positions[i - 1]:
            return 2
    return 0


def empty_changes(dtype: str, numel: int) -> Changes:
    bits = np.empty(0, dtype=uint_dtype(dtype))
    return Changes(dtype, numel, np.empty(0, dtype=np.int64), bits, bits)


@kernel
def _diff_range(old: np.ndarray, new: np.ndarray, start: int, stop: int) -> _Found:
    """(positions, old bits, new bits) of the differing elements in [start, stop), with
    start a multiple of 64. Output grows by doubling: the changed count is not known."""
    size = 1024
    positions = np.empty(size, dtype=np.int64)
    found = 0
    for base in range(start, stop, 64):
        if base + 64 <= stop:
            differ = differ_mask(old, new, base)
        else:
            differ = np.uint64(0)
            for j in range(stop - base):
                differ |= np.uint64(old[base + j] != new[base + j]) << np.uint64(j)
        if found + 64 > size:
            size *= 2
            grown = np.empty(size, dtype=np.int64)
            grown[:found] = positions[:found]
            positions = grown
        while differ:
            positions[found] = base + int(trailing_zeros(differ))
            found += 1
            differ &= differ - np.uint64(1)
    positions = positions[:found].copy()
    old_bits = np.empty(found, dtype=old.dtype)
    new_bits = np.empty(found, dtype=new.dtype)
    for i in range(found):
        old_bits[i] = old[positions[i]]
        new_bits[i] = new[positions[i]]
    return positions, old_bits, new_bits


def diff(old: np.ndarray, new: np.ndarray, dtype: str) -> Changes:
    """Positions whose bit patterns differ between two raw byte arrays, with both bits.

    One compiled pass compares 64 elements at a time (`deltaboard.board.codec.jit.differ_mask`) and
    lists only the differing ones; large tensors are split between the cores.
    """
    old_bits = as_bits(old, dtype, "old")
    new_bits = as_bits(new, dtype, "new")
    if old_bits.size != new_bits.size:
        raise PatchError(f"old has {old_bits.size} elements, new has {new_bits.size}")
    n = old_bits.size
    words = (n + 63) // 64

    def part(first: int, last: int) -> _Found:
        found: _Found = _diff_range(old_bits, new_bits, first * 64, min(last * 64, n))
        return found

    parts = map_ranges(part, words, _PARALLEL_MIN_WORDS)
    if len(parts) == 1:
        return Changes(dtype, int(n), *parts[0])
    positions, before, after = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return Changes(dtype, int(n), positions, before, after)
