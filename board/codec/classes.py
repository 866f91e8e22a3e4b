"""Rank and select within the exponent classes of an old tensor.

A changed position of the `context` encoding is coded as its rank within one of three
classes of the old tensor: elements whose bit pattern without its sign bit (monotone in
|value| for floats) is below `t_low << shift` (class 0, low), below
`t_top << shift` (class 1, mid), or not (class 2, top).

Both directions make one pass over the old tensor, 64 elements (a word) at a time: two
vector compares give the word's class masks (`deltaboard.board.codec.jit.below_mask`), popcounts
keep each class's running count.

* `class_ranks` (encoder): each changed element's rank is its class's count before the
  word plus the popcount of its class mask below it; the pass stops at the last change.
* `class_positions` (decoder): the inverse; the wanted members of a word are picked out of
  its masks by popcount select, and a word's positions are emitted in order, so they come
  out sorted. A rank past its class is never found, which the caller reports.
"""

from __future__ import annotations

import numpy as np

from deltaboard.board.codec.bitio import RiceCursor, RiceGroups, next_index, rice_cursor
from deltaboard.board.codec.context import EXPONENT_FIELDS, class_limits
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import (
    FAST_DEPOSIT,
    below_mask,
    deposit,
    inlined,
    kernel,
    popcount,
    trailing_zeros,
)

_PAST = np.iinfo(np.int64).max  # a rank past every class: the next wanted rank of a class with none left


def _limits(
    old_bits: np.ndarray, dtype: str, t_low: int, t_top: int
) -> tuple[np.generic, np.generic, np.generic]:
    """(sign mask, low limit, top limit) in the element's own unsigned type."""
    low, top = class_limits(dtype, t_low, t_top)
    t = old_bits.dtype.type
    return t((1 << (8 * old_bits.dtype.itemsize - 1)) - 1), t(low), t(top)


@kernel
def split_by_class(
    old: np.ndarray,
    positions: np.ndarray,
    ranks: np.ndarray,
    sign: np.generic,
    low: np.generic,
    top: np.generic,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(ranks of class 0, 1, 2, status): status 1 if a rank is negative or past its
    position, 2 if the ranks of a class do not increase."""
    out = np.empty((3, ranks.size), dtype=np.int64)
    sizes = np.zeros(3, dtype=np.int64)
    for j in range(ranks.size):
        m = old[j] & sign
        c = 0 if m < low else (1 if m < top else 2)
        r = ranks[j]
        if r < 0 or r > positions[j]:
            return out[0, :0], out[1, :0], out[2, :0], 1
        if sizes[c] and out[c, sizes[c] - 1] >= r:
            return out[0, :0], out[1, :0], out[2, :0], 2
        out[c, sizes[c]] = r
        sizes[c] += 1
    return out[0, : sizes[0]], out[1, : sizes[1]], out[2, : sizes[2]], 0


def split_ranks(
    changed_old_bits: np.ndarray, dtype: str, t_low: int, t_top: int, positions: np.ndarray, ranks: np.ndarray
) -> list[np.ndarray]:
    """The ranks of each class (0, 1, 2) from the changed elements' old bits, checked:
    PatchError unless each is at most its position and they increase within a class."""
    limits = _limits(changed_old_bits, dtype, t_low, t_top)
    r0, r1, r2, status = split_by_class(
        changed_old_bits, positions, ranks.astype(np.int64, copy=False), *limits
    )
    if status == 1:
        raise PatchError("context hint: a rank outside its class")
    if status == 2:
        raise PatchError("context hint: ranks not increasing within a class")
    return [r0, r1, r2]


@kernel
def _masks(
    old: np.ndarray, base: int, sign: np.generic, low: np.generic, top: np.generic
) -> tuple[np.uint64, np.uint64, np.uint64]:
    """Class masks (low, mid, top) of the 64-element word starting at `base`."""
    if base + 64 <= old.size:
        low_mask = below_mask(old, base, low)
        small = below_mask(old, base, top)
        return low_mask, small & ~low_mask, ~small
    low_mask = np.uint64(0)
    small = np.uint64(0)
    for j in range(old.size - base):
        m = old[base + j] & sign
        low_mask |= np.uint64(m < low) << np.uint64(j)
        small |= np.uint64(m < top) << np.uint64(j)
    whole = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - (old.size - base))
    return low_mask, small & ~low_mask, whole & ~small


@kernel
def _ranks(
    old: np.ndarray, positions: np.ndarray, sign: np.generic, low: np.generic, top: np.generic
) -> np.ndarray:
    ranks = np.empty(positions.size, dtype=np.int64)
    c0 = c1 = c2 = 0  # members of each class before word `base`
    j = 0
    for base in range(0, old.size, 64):
        if j == positions.size:
            break
        m0, m1, m2 = _masks(old, base, sign, low, top)
        while j < positions.size and positions[j] < base + 64:
            p = positions[j]
            before = (np.uint64(1) << np.uint64(p - base)) - np.uint64(1)
            m = old[p] & sign
            if m < low:
                ranks[j] = c0 + int(popcount(m0 & before))
            elif m < top:
                ranks[j] = c1 + int(popcount(m1 & before))
            else:
                ranks[j] = c2 + int(popcount(m2 & before))
            j += 1
        c0 += int(popcount(m0))
        c1 += int(popcount(m1))
        c2 += int(popcount(m2))
    return ranks


@kernel
def ranks_within(old: np.ndarray, positions: np.ndarray, shift: int, t_low: int, t_top: int) -> np.ndarray:
    """`class_ranks` for thresholds of an exponent field at `shift`, compiled (the codec's
    own hint calls it from compiled code)."""
    limits = np.empty(3, dtype=old.dtype)  # `_limits`, in the element's own type
    limits[0] = (np.uint64(1) << np.uint64(8 * old.itemsize - 1)) - np.uint64(1)
    limits[1] = np.uint64(t_low) << np.uint64(shift)
    limits[2] = np.uint64(t_top) << np.uint64(shift)
    return _ranks(old, positions, limits[0], limits[1], limits[2])


def class_ranks(
    old_bits: np.ndarray, dtype: str, t_low: int, t_top: int, positions: np.ndarray
) -> np.ndarray:
    """Rank of each changed position (sorted, in range) within its class of the old tensor."""
    shift = EXPONENT_FIELDS[dtype][0]
    ranks: np.ndarray = ranks_within(old_bits, positions.astype(np.int64, copy=False), shift, t_low, t_top)
    return ranks


@kernel
def _select_bit_search(word: np.uint64, k: int) -> np.uint64:
    """The k-th (from 0) set bit of `word` alone, k < popcount(word): a binary search on
    the popcounts of halves in masks, not branches (its steps are unpredictable). Where
    BMI2's deposit is fast, `_select_bit` is that one instruction instead: a hit per
    word or so at ~1% changed makes this search a large part of the decoder's pass."""
    at = np.uint64(0)
    left = np.uint64(k)
    for half in (32, 16, 8, 4, 2, 1):
        h = np.uint64(half)
        below = popcount(word & ((np.uint64(1) << h) - np.uint64(1)))
        right = np.uint64(0) - np.uint64(left >= below)  # all ones when the bit is above
        left -= below & right
        word = ((word >> h) & right) | (word & ~right)
        at += h & right
    return np.uint64(1) << at


@kernel
def _select_bit_deposit(word: np.uint64, k: int) -> np.uint64:
    """`_select_bit_search` in one instruction (only where `FAST_DEPOSIT`)."""
    return deposit(np.uint64(1) << np.uint64(k), word)


_select_bit = _select_bit_deposit if FAST_DEPOSIT else _select_bit_search


# A class of `_select`: its next wanted rank, its ranks' Rice cursor, how many of its ranks
# are left to read, its members before the current word
ClassState = tuple[int, RiceCursor, int, int]


@kernel
def _next_rank(buf: np.ndarray, state: ClassState, limit: int) -> ClassState:
    """The class with its next wanted rank read (`bitio.next_index`), or `_PAST` when it
    has none left or the rank leaves [0, limit)."""
    rank, cursor, left, members = state
    if left == 0:
        return _PAST, cursor, 0, members
    rank, cursor = next_index(buf, cursor, rank, limit)
    if rank < 0:  # never found: the select reports it
        return _PAST, cursor, 0, members
    return rank, cursor, left - 1, members


@inlined
def _pick(mask: np.uint64, state: ClassState, buf: np.ndarray, limit: int) -> tuple[np.uint64, ClassState]:
    """(bits of one class's wanted members in this word, the class after the word)."""
    hits = np.uint64(0)
    count = state[3]
    members = count + int(popcount(mask))
    while state[0] < members:
        hits |= _select_bit(mask, state[0] - count)
        state = _next_rank(buf, state, limit)
    return hits, (state[0], state[1], state[2], members)


@inlined
def _emit(
    old: np.ndarray, base: int, hits: np.uint64, out: np.ndarray, out_old: np.ndarray, found: int
) -> int:
    """The positions of a word's wanted members and their old bits, written in order from
    `found` (the new count returned)."""
    while hits:
        p = base + int(trailing_zeros(hits))
        out[found] = p
        out_old[found] = old[p]  # in cache now: no second, random-access gather
        found += 1
        hits &= hits - np.uint64(1)
    return found


@inlined
def _word(
    old: np.ndarray,
    base: int,
    masks: tuple[np.uint64, np.uint64, np.uint64],
    classes: tuple[ClassState, ClassState, ClassState],
    buf: np.ndarray,
    out: np.ndarray,
    out_old: np.ndarray,
    found: int,
) -> tuple[tuple[ClassState, ClassState, ClassState], int]:
    """One word of `_select`: its wanted members' positions and old bits written from
    `found`; (the classes after the word, the new count)."""
    h0, c0 = _pick(masks[0], classes[0], buf, old.size)
    h1, c1 = _pick(masks[1], classes[1], buf, old.size)
    h2, c2 = _pick(masks[2], classes[2], buf, old.size)
    return (c0, c1, c2), _emit(old, base, h0 | h1 | h2, out, out_old, found)


@kernel
def _first(buf: np.ndarray, ranks: int, unary_bit: int, field_bit: int, k: int, limit: int) -> ClassState:
    """A class before the first word, its first wanted rank read."""
    return _next_rank(buf, (-1, rice_cursor(buf, unary_bit, field_bit, k), ranks, 0), limit)


@kernel
def _select(
    old: np.ndarray,
    sign: np.generic,
    low: np.generic,
    top: np.generic,
    buf: np.ndarray,
    unary_bits: np.ndarray,
    field_bits: np.ndarray,
    ks: np.ndarray,
    counts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, int]:
    """(positions, old bits there, how many were found) of the wanted members, each
    class's ranks read from its Rice-coded gaps (`bitio.RiceGroups`) as the pass reaches
    them; fewer are found when a rank lies past its class or the tensor.

    A whole word's masks are two vector compares; the last, partial word's come from
    `_masks`, a call off the hot path (compiled into the loop, its scalar loop made the
    pass several times slower: docs/design.md). One word body serves both, so that each
    class's steps are compiled once, not twice: every test run compiles the codec. The
    classes are tuples of scalars, not arrays, so that they stay in registers."""
    out = np.empty(counts[0] + counts[1] + counts[2], dtype=np.int64)
    out_old = np.empty(out.size, dtype=old.dtype)
    classes = (
        _first(buf, counts[0], unary_bits[0], field_bits[0], ks[0], old.size),
        _first(buf, counts[1], unary_bits[1], field_bits[1], ks[1], old.size),
        _first(buf, counts[2], unary_bits[2], field_bits[2], ks[2], old.size),
    )
    found = 0
    whole = old.size - old.size % 64
    for base in range(0, whole, 64):
        if found == out.size:
            break
        low_mask = below_mask(old, base, low)
        small = below_mask(old, base, top)
        classes, found = _word(
            old, base, (low_mask, small & ~low_mask, ~small), classes, buf, out, out_old, found
        )
    if whole < old.size and found < out.size:
        classes, found = _word(
            old, whole, _masks(old, whole, sign, low, top), classes, buf, out, out_old, found
        )
    return out, out_old, found


def class_positions(
    old_bits: np.ndarray, dtype: str, t_low: int, t_top: int, ranks: RiceGroups
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `class_ranks`: the sorted positions of the members of each class whose
    ranks are given as Rice-coded gaps (`bitio.encode_index_sets` of each class's strictly
    increasing ranks), and the old bits there; PatchError if a rank lies past its class
    or the tensor."""
    if ranks.counts.size != 3:
        raise PatchError("corrupted patch: context positions need the ranks of three classes")
    positions, old_at, found = _select(
        old_bits,
        *_limits(old_bits, dtype, t_low, t_top),
        ranks.buf,
        ranks.unary_bits,
        ranks.field_bits,
        ranks.ks,
        ranks.counts,
    )
    if found != positions.size:
        raise PatchError("corrupted patch: a changed element's rank lies past its class")
    return positions, old_at
