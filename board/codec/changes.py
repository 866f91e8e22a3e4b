"""What changed between two versions of a tensor: positions and bit patterns.

`Changes` is the codec's common currency: `diff` produces it from two byte arrays on the
host, the publisher's device path produces the same thing on the tensors' own device, the
encoder codes it and `decode` gives it back to in-place writers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from board.codec.dtypes import as_bits, uint_dtype, width
from board.codec.errors import PatchError
from board.codec.parallel import chunks, map_ranges

_WORD_CHUNK = 1 << 16


@dataclass(frozen=True)
class Changes:
    """Elements whose bits differ. `positions` is int64, strictly increasing, < numel;
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
        if n and (self.positions[0] < 0 or self.positions[-1] >= self.numel):
            raise PatchError("changes: a position lies outside the tensor")
        if n > 1 and not bool(np.all(self.positions[1:] > self.positions[:-1])):
            raise PatchError("changes: positions are not strictly increasing")


def empty_changes(dtype: str, numel: int) -> Changes:
    bits = np.empty(0, dtype=uint_dtype(dtype))
    return Changes(dtype, numel, np.empty(0, dtype=np.int64), bits, bits)


def _changed_words(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Indices of differing 64-bit words, scanned in cache-sized chunks on every core."""

    def part(start: int, stop: int) -> np.ndarray:
        found = [np.flatnonzero(old[a:b] != new[a:b]) + a for a, b in chunks(start, stop, _WORD_CHUNK)]
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    return np.concatenate(map_ranges(part, old.size))


def diff(old: np.ndarray, new: np.ndarray, dtype: str) -> Changes:
    """Positions whose bit patterns differ between two raw byte arrays, with both bits.

    The comparison runs on 64-bit words (8/width elements at once) so that the full pass
    reads memory at close to its bandwidth; only differing words are split into elements.
    """
    old_bits = as_bits(old, dtype, "old")
    new_bits = as_bits(new, dtype, "new")
    if old_bits.size != new_bits.size:
        raise PatchError(f"old has {old_bits.size} elements, new has {new_bits.size}")
    w = width(dtype)
    per = 8 // w
    nwords = old_bits.size // per
    head = nwords * per
    words = _changed_words(old_bits[:head].view("<u8"), new_bits[:head].view("<u8"))
    if per == 1:
        positions = words.astype(np.int64)
    else:
        # the XOR of a changed word viewed as its elements (memory order is element order)
        x = old_bits[:head].view("<u8")[words] ^ new_bits[:head].view("<u8")[words]
        lanes = np.flatnonzero(x.view(old_bits.dtype))
        shift = per.bit_length() - 1  # per is 2, 4 or 8
        positions = (words[lanes >> shift].astype(np.int64) << shift) | (lanes & (per - 1))
    tail = np.flatnonzero(old_bits[head:] != new_bits[head:]) + head
    if tail.size:
        positions = np.concatenate([positions, tail.astype(np.int64)])
    return Changes(dtype, int(old_bits.size), positions, old_bits[positions], new_bits[positions])
