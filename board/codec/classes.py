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

_CHUNK = 1 << 17  # elements per pass chunk: a multiple of 64, its temporaries fit in L2
_SELECT_CHUNK = 1 << 14  # members per select piece
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


def _words(packed: np.ndarray) -> np.ndarray:
    if packed.size % 8:
        padded = np.zeros((packed.size + 7) // 8 * 8, dtype=np.uint8)
        padded[: packed.size] = packed
        packed = padded
    return packed.view("<u8")


def split_classes(old_bits: np.ndarray, dtype: str, t_low: int, t_top: int) -> PositionClasses:
    """Class membership of every element of the old tensor (one branch-free pass).

    Each cache-sized chunk is packed straight into its place in the shared word array
    (no per-class arrays to concatenate afterwards: at these sizes fresh allocations and
    extra copies cost as much as the comparisons). Chunks start on whole words.
    """
    shift, _ = EXPONENT_FIELDS[dtype]
    low_limit, top_limit = (old_bits.dtype.type(t << shift) for t in (t_low, t_top))
    n = old_bits.size
    nwords = (n + 63) // 64
    words = np.empty(3 * nwords, dtype=np.uint64)

    def part(first: int, stop: int) -> None:
        for a, b in chunks(first * _CHUNK, min(stop * _CHUNK, n), _CHUNK):
            m = magnitude_bits(old_bits[a:b])
            wa, wb = a // 64, (b + 63) // 64
            low = _words(np.packbits(m < low_limit, bitorder="little"))
            small = _words(np.packbits(m < top_limit, bitorder="little"))
            words[wa:wb] = low
            np.bitwise_and(small, ~low, out=words[nwords + wa : nwords + wb])
            np.invert(small, out=words[2 * nwords + wa : 2 * nwords + wb])

    map_ranges(part, (n + _CHUNK - 1) // _CHUNK, 4)
    if n % 64:
        words[-1] &= np.uint64((1 << (n % 64)) - 1)
    before = np.empty(words.size + 1, dtype=np.int64)
    before[0] = 0
    np.cumsum(np.bitwise_count(words), out=before[1:])
    return PositionClasses(int(n), int(nwords), words, before)


def class_of(old_bits: np.ndarray, dtype: str, t_low: int, t_top: int) -> np.ndarray:
    """0 (low), 1 (mid) or 2 (top) for the given old bits (same rule as `split_classes`)."""
    shift, _ = EXPONENT_FIELDS[dtype]
    m = magnitude_bits(old_bits)
    # low implies small, so the class is the number of limits the magnitude reaches
    cls: np.ndarray = (m >= old_bits.dtype.type(t_low << shift)).astype(np.int64)
    cls += m >= old_bits.dtype.type(t_top << shift)
    return cls


def class_ranks(classes: PositionClasses, positions: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Rank of each position within its class (the number of class members before it)."""
    w = cls * classes.nwords + (positions >> 6)
    below = (np.uint64(1) << (positions & 63).astype(np.uint64)) - np.uint64(1)
    inside = np.bitwise_count(classes.words[w] & below).astype(np.int64)
    ranks: np.ndarray = classes.before[w] + inside - classes.offset(cls)
    return ranks


def class_positions(classes: PositionClasses, members: np.ndarray) -> np.ndarray:
    """Inverse of `class_ranks`: the position of each member, given as its index in the
    member sequence of all classes (rank within its class plus `offset` of the class).

    The word comes from a binary search on the cumulative counts; within it, the byte from
    SWAR prefix popcounts of its bytes (no per-row numpy reductions), the bit from a table.
    Cache-sized pieces keep the dozen temporaries in L2. Measured faster than listing a
    class's members even at a quarter of elements changed.
    """
    positions = np.empty(members.size, dtype=np.int64)
    for start, stop in chunks(0, members.size, _SELECT_CHUNK):
        target = members[start:stop]
        w = np.searchsorted(classes.before, target, side="right") - 1
        k = (target - classes.before[w]).astype(np.uint64)
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
        positions[start:stop] = (w % classes.nwords) * 64 + b.astype(np.int64) * 8 + bit
    return positions
