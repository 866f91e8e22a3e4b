"""Rank and select within the exponent classes of an old tensor, on packed bit masks.

`split_classes` makes one pass over the old bits: two comparisons of the sign-less bit
pattern (`board.codec.context.magnitude_bits`) against the class thresholds, packed 64
elements to a word. Per class it keeps the words and the number of members before each
word, so that

* `rank(c, p)`: the number of class-c elements before position p (encoder), and
* `select(c, r)`: the position of the r-th class-c element (decoder)

cost O(1) word operations per changed element. Packing keeps the full pass branch-free;
listing every small element's position instead (`flatnonzero`) costs several times more.
The three classes share one array of words so that a single vectorised call ranks or
selects the changes of all classes (numpy call overhead dominates at these sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from board.codec.context import EXPONENT_FIELDS, magnitude_bits
from board.codec.parallel import chunks, map_ranges

_CHUNK = 1 << 18  # elements per pass chunk: a multiple of 64, small enough for L2
_U1, _U2, _U4, _U8 = np.uint64(1), np.uint64(2), np.uint64(4), np.uint64(8)
_M55, _M33, _M0F = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333), np.uint64(0x0F0F0F0F0F0F0F0F)
_L01, _H80, _MFF = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080), np.uint64(0xFF)
# _SELECT8[v, j]: the bit index (LSB first) of the j-th set bit of byte v
_SELECT8 = np.zeros((256, 8), dtype=np.int64)
for _v in range(256):
    _set = [j for j in range(8) if _v >> j & 1]
    _SELECT8[_v, : len(_set)] = _set


@dataclass(frozen=True)
class PositionClasses:
    """Membership words of the three classes (0 low, 1 mid, 2 top) laid end to end, so
    that one vectorised rank or select serves all classes: `words[c * nwords + w]` holds
    elements 64w..64w+63 of class c and `before[c * nwords + w]` counts the members of
    classes < c plus those of class c before word w (`before[-1]` is numel)."""

    numel: int
    nwords: int
    words: np.ndarray
    before: np.ndarray

    @property
    def sizes(self) -> tuple[int, int, int]:
        starts = [int(self.before[c * self.nwords]) for c in range(3)] + [int(self.before[-1])]
        return starts[1] - starts[0], starts[2] - starts[1], starts[3] - starts[2]

    def offset(self, c: np.ndarray) -> np.ndarray:
        """Members of the classes before class c (the rank offset of class c)."""
        firsts: np.ndarray = self.before[c * self.nwords]
        return firsts


def _packed(old_bits: np.ndarray, limits: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Little-endian bit masks (as uint8) of `magnitude < limit` for both limits."""
    low_limit, top_limit = (old_bits.dtype.type(x) for x in limits)

    def part(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        lows, smalls = [], []
        for a, b in chunks(start, stop, _CHUNK):
            m = magnitude_bits(old_bits[a:b], "")
            lows.append(np.packbits(m < low_limit, bitorder="little"))
            smalls.append(np.packbits(m < top_limit, bitorder="little"))
        if len(lows) == 1:
            return lows[0], smalls[0]
        empty = np.empty(0, dtype=np.uint8)
        return (np.concatenate(lows) if lows else empty), (np.concatenate(smalls) if smalls else empty)

    # ranges must start on whole bytes (and words): split on multiples of the chunk size
    n = old_bits.size
    pieces = map_ranges(lambda a, b: part(a * _CHUNK, min(b * _CHUNK, n)), (n + _CHUNK - 1) // _CHUNK, 4)
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces])


def _words(packed: np.ndarray) -> np.ndarray:
    if packed.size % 8:
        padded = np.zeros((packed.size + 7) // 8 * 8, dtype=np.uint8)
        padded[: packed.size] = packed
        packed = padded
    return packed.view("<u8")


def split_classes(old_bits: np.ndarray, dtype: str, t_low: int, t_top: int) -> PositionClasses:
    """Class membership of every element of the old tensor (one branch-free pass)."""
    shift, _ = EXPONENT_FIELDS[dtype]
    low_bytes, small_bytes = _packed(old_bits, (t_low << shift, t_top << shift))
    low, small = _words(low_bytes), _words(small_bytes)
    top = ~small
    n = old_bits.size
    if top.size and n % 64:
        top[-1] &= np.uint64((1 << (n % 64)) - 1)
    words = np.concatenate([low, small & ~low, top])
    before = np.zeros(words.size + 1, dtype=np.int64)
    np.cumsum(np.bitwise_count(words), out=before[1:])
    return PositionClasses(int(n), int(low.size), words, before)


def class_of(old_bits: np.ndarray, dtype: str, t_low: int, t_top: int) -> np.ndarray:
    """0 (low), 1 (mid) or 2 (top) for the given old bits (same rule as `split_classes`)."""
    shift, _ = EXPONENT_FIELDS[dtype]
    m = magnitude_bits(old_bits, dtype)
    low = m < old_bits.dtype.type(t_low << shift)
    small = m < old_bits.dtype.type(t_top << shift)
    return np.where(low, 0, np.where(small, 1, 2)).astype(np.int64)


def class_ranks(classes: PositionClasses, positions: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Rank of each position within its class (the number of class members before it)."""
    w = cls * classes.nwords + (positions >> 6)
    below = (np.uint64(1) << (positions & 63).astype(np.uint64)) - np.uint64(1)
    inside = np.bitwise_count(classes.words[w] & below).astype(np.int64)
    ranks: np.ndarray = classes.before[w] + inside - classes.offset(cls)
    return ranks


def class_positions(classes: PositionClasses, ranks: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Inverse of `class_ranks`: the position of the r-th member of class c, for each (r, c).

    The word comes from a binary search on the cumulative counts; within it, the byte from
    SWAR prefix popcounts of its bytes (no per-row numpy reductions), the bit from a table.
    Measured faster than listing a class's members even at a quarter of elements changed.
    """
    w = np.searchsorted(classes.before, ranks + classes.offset(cls), side="right") - 1
    k = (ranks + classes.offset(cls) - classes.before[w]).astype(np.uint64)
    word = classes.words[w]
    x = word - ((word >> _U1) & _M55)
    x = (x & _M33) + ((x >> _U2) & _M33)
    x = (x + (x >> _U4)) & _M0F  # popcount of each byte
    cum = x * _L01  # byte j: popcount of bytes 0..j
    reached = ((cum | _H80) - (k + _U1) * _L01) & _H80  # bytes whose prefix count exceeds k
    b = np.uint64(8) - np.bitwise_count(reached).astype(np.uint64)
    prev = np.where(b > 0, (cum >> (_U8 * (np.maximum(b, _U1) - _U1))) & _MFF, 0).astype(np.uint64)
    byte = (word >> (_U8 * b)) & _MFF
    bit = _SELECT8[byte.astype(np.int64), (k - prev).astype(np.int64)]
    positions: np.ndarray = (w - cls * classes.nwords) * 64 + b.astype(np.int64) * 8 + bit
    return positions
