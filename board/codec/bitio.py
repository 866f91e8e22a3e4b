"""Byte sections and Rice coding: the codec's only entropy coder.

A payload is a sequence of fields (u64) and length-prefixed byte sections; `Reader` checks
every bound so that truncated or corrupted input raises PatchError, never IndexError.

Rice coding with parameter k writes `v >> k` in unary and the low k bits verbatim. For the
geometric-like gaps between changed positions it is within a few hundredths of a bit of
the entropy when k is chosen from the mean, and it is simple enough for tight compiled
loops (`deltaboard.board.codec.jit`): the unary parts of all groups go to one bit
stream (q zeros then a one) and each group's remainders to a fixed-width section, so
decoding needs no per-value branching on the parameter.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import inlined, kernel, leading_zeros, popcount, word_be

_GOLDEN = (1 + math.sqrt(5)) / 2


class Writer:
    """Accumulates fields and sections of a payload."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def u64(self, value: int) -> None:
        """An unsigned integer < 2**64 as a LEB128 varint (small fields cost one byte)."""
        out = bytearray()
        while True:
            byte = value & 0x7F
            value >>= 7
            if value:
                out.append(byte | 0x80)
            else:
                out.append(byte)
                break
        self._parts.append(bytes(out))

    def section(self, data: bytes) -> None:
        self.u64(len(data))
        self._parts.append(data)

    def extend(self, data: bytes) -> None:
        """Fields and sections already written (by a compiled `put_*` kernel)."""
        self._parts.append(data)

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class Reader:
    """Reads fields and sections back, refusing to run past the end."""

    def __init__(self, data: bytes | memoryview) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def u64(self) -> int:
        value = shift = 0
        while True:
            if self._pos >= len(self._data):
                raise PatchError("patch is truncated (field past the end)")
            byte = self._data[self._pos]
            self._pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift >= 64:
                raise PatchError("corrupted patch: varint too long")
        if value >> 64:
            raise PatchError("corrupted patch: varint out of range")
        return value

    def section(self) -> memoryview:
        n = self.u64()
        if n > len(self._data) - self._pos:
            raise PatchError("patch is truncated (section past the end)")
        out = self._data[self._pos : self._pos + n]
        self._pos += n
        return out

    def done(self) -> None:
        if self._pos != len(self._data):
            raise PatchError("patch has trailing bytes after its payload")


@kernel
def _low_bits(x: np.uint64, k: int) -> np.uint64:
    """The low k < 64 bits of x."""
    return x & ((np.uint64(1) << np.uint64(k)) - np.uint64(1))


@kernel
def grow(buf: np.ndarray, at: int, extra: int) -> np.ndarray:
    """`buf` (bytes written up to `at`) with room for `extra` more: the compiled encoders
    write a payload into one buffer that doubles as it fills."""
    if at + extra <= buf.size:
        return buf
    out = np.zeros(max(2 * buf.size, at + extra), dtype=np.uint8)
    out[:at] = buf[:at]
    return out


@kernel
def put_u64(buf: np.ndarray, at: int, value: int) -> tuple[np.ndarray, int]:
    """`Writer.u64` into a buffer: (buffer, end)."""
    buf = grow(buf, at, 10)
    v = np.uint64(value)
    while v >= np.uint64(0x80):
        buf[at] = np.uint8((v & np.uint64(0x7F)) | np.uint64(0x80))
        v >>= np.uint64(7)
        at += 1
    buf[at] = np.uint8(v)
    return buf, at + 1


@kernel
def put_section(buf: np.ndarray, at: int, data: np.ndarray) -> tuple[np.ndarray, int]:
    """`Writer.section` into a buffer: (buffer, end)."""
    buf, at = put_u64(buf, at, data.size)
    buf = grow(buf, at, data.size)
    buf[at : at + data.size] = data
    return buf, at + data.size


@kernel
def put_fixed(buf: np.ndarray, at: int, values: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """The low k bits of each uint64 value, MSB first, packed, as one section."""
    size = (values.size * k + 7) // 8
    buf, at = put_u64(buf, at, size)
    buf = grow(buf, at, size)
    buf[at : at + size] = 0
    acc = np.uint64(0)  # pending bits, right-aligned; fewer than 8 between values
    held = 0
    o = at
    for v in values:
        # at most 32 bits at a time so that acc never overflows (k may be up to 63)
        left = k
        while left > 0:
            take = min(left, 32)
            left -= take
            acc = (acc << np.uint64(take)) | _low_bits(v >> np.uint64(left), take)
            held += take
            while held >= 8:
                held -= 8
                buf[o] = np.uint8((acc >> np.uint64(held)) & np.uint64(0xFF))
                o += 1
    if held:
        buf[o] = np.uint8((acc << np.uint64(8 - held)) & np.uint64(0xFF))
    return buf, at + size


@inlined
def _short_field(data: np.ndarray, bit: int, k: int) -> np.uint64:
    """The field of up to 56 bits at bit offset `bit` of `data`, read from the big-endian
    word at its first byte (it fits in that word whatever its bit offset)."""
    return _low_bits(word_be(data, bit >> 3) >> np.uint64(64 - k - (bit & 7)), k)


@inlined
def read_field(data: np.ndarray, bit: int, k: int) -> np.uint64:
    """The field of 1 to 63 bits at bit offset `bit` of `data`, which holds a word of
    padding past its last field: one word read, two for more than 56 bits."""
    if k <= 56:
        return _short_field(data, bit, k)
    rest = bit + k - 32
    return (_short_field(data, bit, k - 32) << np.uint64(32)) | _short_field(data, rest, 32)


@kernel
def _group_starts(unary: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, bool]:
    """The bit where each group's quotients start in the unary stream (group g after the
    ones of the groups before it), and whether the stream holds a one for every value.

    `unary` is the stream padded with zeros to whole words (the padding holds no one); a
    word at a time, by popcount, with a group's first bit located in its word by counts
    of leading zeros: one pass that reads the stream, writes nothing per value."""
    starts = np.zeros(counts.size, dtype=np.int64)
    total = 0
    for c in counts:
        total += c
    g = 1
    target = counts[0] if counts.size else 0  # ones before group g's first quotient
    while g < counts.size and target == 0:  # the groups after empty ones start at bit 0
        target += counts[g]
        g += 1
    seen = 0  # ones before word w
    for w in range(unary.size // 8):
        if seen >= total:
            break
        x = word_be(unary, 8 * w)
        ones = int(popcount(x))
        while g < counts.size and target <= seen + ones:  # its last one is in this word
            y = x
            for _ in range(target - seen - 1):  # drop the ones before that one
                y &= ~(np.uint64(0x8000000000000000) >> leading_zeros(y))
            starts[g] = 64 * w + int(leading_zeros(y)) + 1
            target += counts[g]
            g += 1
        seen += ones
    return starts, seen >= total


# A group's read position: (byte of the next unary word, the current word's bits not yet
# read, left-aligned, how many they are, the bit of the next fixed-width field, k)
RiceCursor = tuple[int, np.uint64, int, int, int]


@kernel
def rice_cursor(buf: np.ndarray, unary_bit: int, field_bit: int, k: int) -> RiceCursor:
    """The cursor of a group whose quotients start at `unary_bit` of `buf` (a word-aligned
    unary stream) and whose fields start at `field_bit`."""
    at = unary_bit >> 6 << 3
    skip = unary_bit & 63
    return at + 8, word_be(buf, at) << np.uint64(skip), 64 - skip, field_bit, k


@kernel
def next_value(buf: np.ndarray, cursor: RiceCursor) -> tuple[np.uint64, RiceCursor]:
    """One Rice-coded value read at a group's cursor: (value, the cursor moved past it).

    The current unary word is kept in the cursor, so that a quotient costs a count of
    leading zeros and two shifts, not a load whose address waits for the last quotient.
    The caller guarantees a one ahead of the cursor in the unary stream (`rice_groups`
    counted them) and a word of padding after the fields, so that every word read lies
    in `buf` and the first one found ends the quotient."""
    at, bits, held, field_bit, k = cursor
    q = np.uint64(0)
    while bits == 0:  # the rest of the word is zeros of this quotient
        q += np.uint64(held)
        bits = word_be(buf, at)
        at += 8
        held = 64
    lead = leading_zeros(bits)
    q += lead
    bits = (bits << lead) << np.uint64(1)  # lead + 1 may be 64: two shifts
    held -= int(lead) + 1
    if k == 0:
        return q, (at, bits, held, field_bit, k)
    return (q << np.uint64(k)) | read_field(buf, field_bit, k), (at, bits, held, field_bit + k, k)


@kernel
def next_index(buf: np.ndarray, cursor: RiceCursor, last: int, limit: int) -> tuple[int, RiceCursor]:
    """The index after `last` in a strictly increasing set coded as gaps (`encode_index_sets`),
    read at the set's cursor, or -1 where it leaves [0, limit): (index, the cursor moved on)."""
    gap, cursor = next_value(buf, cursor)
    if gap >= np.uint64(limit):  # bounded first, so that the sum stays far from wrap-around
        return -1, cursor
    index = last + int(gap) + 1
    return (index if index < limit else -1), cursor


@kernel
def _set_indices(
    buf: np.ndarray, unary_bit: int, field_bit: int, k: int, count: int, limit: int
) -> np.ndarray:
    """A set of `count` indices coded as gaps, or an empty array if one leaves [0, limit)."""
    out = np.empty(count, dtype=np.int64)
    cursor = rice_cursor(buf, unary_bit, field_bit, k)
    last = -1
    for j in range(count):
        last, cursor = next_index(buf, cursor, last, limit)
        if last < 0:
            return out[:0]
        out[j] = last
    return out


@kernel
def best_k(values: np.ndarray) -> int:
    """The Rice parameter for geometric-like values of this mean (one pass, no search).

    k = ceil(log2(log(phi - 1) / log(mu / (mu + 1)))) is optimal for a geometric
    distribution of mean mu (Kiely 2004); it also bounds the unary part to about two bits
    per value on average whatever the distribution, since sum(v >> k) <= n * mu / 2**k.
    """
    if values.size == 0:
        return 0
    total = 0.0
    for v in values:
        total += float(v)
    mu = total / values.size
    if mu <= 0.0:
        return 0
    ratio = math.log(_GOLDEN - 1.0) / math.log1p(-1.0 / (mu + 1.0))
    return max(0, min(63, math.ceil(math.log2(ratio))))


@kernel
def put_rice(buf: np.ndarray, at: int, values: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, int]:
    """Groups of uint64 values Rice-coded, each with its own parameter, group g being
    `values[bounds[g]:bounds[g + 1]]`.

    One unary stream serves all groups, then each group's remainders follow in a section
    of fixed-width fields; one compiled call writes it all, since per-call overhead
    dominates at patch sizes.
    """
    groups = bounds.size - 1
    ks = np.empty(groups, dtype=np.int64)
    for g in range(groups):
        ks[g] = best_k(values[bounds[g] : bounds[g + 1]])
        buf, at = put_u64(buf, at, ks[g])
    bits = 0
    for g in range(groups):
        for i in range(bounds[g], bounds[g + 1]):
            bits += int(values[i] >> np.uint64(ks[g])) + 1
    size = (bits + 7) // 8
    buf, at = put_u64(buf, at, size)
    buf = grow(buf, at, size)
    buf[at : at + size] = 0
    bit = 0
    for g in range(groups):  # q zeros then a one for each quotient q, MSB first
        for i in range(bounds[g], bounds[g + 1]):
            bit += int(values[i] >> np.uint64(ks[g]))
            buf[at + (bit >> 3)] |= np.uint8(0x80 >> (bit & 7))
            bit += 1
    at += size
    for g in range(groups):
        buf, at = put_fixed(buf, at, values[bounds[g] : bounds[g + 1]], ks[g])
    return buf, at


@kernel
def put_index_sets(
    buf: np.ndarray, at: int, positions: np.ndarray, bounds: np.ndarray
) -> tuple[np.ndarray, int]:
    """`encode_index_sets` into a buffer, set g being `positions[bounds[g]:bounds[g + 1]]`."""
    gaps = np.empty(positions.size, dtype=np.uint64)
    for g in range(bounds.size - 1):
        last = -1
        for i in range(bounds[g], bounds[g + 1]):
            gaps[i] = np.uint64(positions[i] - last - 1)
            last = positions[i]
    return put_rice(buf, at, gaps, bounds)


def _joined(groups: Sequence[np.ndarray], dtype: type[np.generic]) -> tuple[np.ndarray, np.ndarray]:
    """The groups end to end, and their bounds (g from bounds[g] to bounds[g + 1])."""
    bounds = np.array([0, *itertools.accumulate(g.size for g in groups)], dtype=np.int64)
    if len(groups) == 1:
        return groups[0].astype(dtype, copy=False), bounds
    joined = np.concatenate([g.astype(dtype, copy=False) for g in groups]) if groups else np.empty(0, dtype)
    return joined, bounds


def written(put: Callable[..., tuple[np.ndarray, int]], *args: object) -> bytes:
    """What a `put_*` kernel, called as `put(buffer, 0, *args)`, writes into a fresh buffer."""
    buf, end = put(np.zeros(256, dtype=np.uint8), 0, *args)
    return bytes(buf[:end])


@dataclass(frozen=True)
class RiceGroups:
    """Groups of values written by `put_rice`, checked and ready to read in place: where
    each group starts in `buf` (`rice_cursor`, then `next_value`), so that a decoder can
    take the values as it needs them, with no array of quotients, fields or values in
    between."""

    buf: np.ndarray
    unary_bits: np.ndarray
    field_bits: np.ndarray
    ks: np.ndarray
    counts: np.ndarray


def rice_groups(r: Reader, counts: Sequence[int]) -> RiceGroups:
    """Read the parameters and sections of groups of `counts` values written by `put_rice`:
    PatchError if a section holds too few bits for its values. `buf` is the unary stream
    then the groups' fixed-width sections, each followed by a word of zeros."""
    ks = [r.u64() for _ in counts]
    if any(k > 63 for k in ks):
        raise PatchError(f"corrupted patch: Rice parameters {ks}")
    unary = r.section()
    total = sum(counts)
    if total > len(unary) * 8:
        raise PatchError("patch is truncated or corrupted (too few coded values)")
    fields = [r.section() for _ in counts]
    if any(len(f) * 8 < n * k for f, n, k in zip(fields, counts, ks, strict=True)):
        raise PatchError("patch is truncated or corrupted (fixed-width bits missing)")
    words = -(-len(unary) // 8) * 8 + 8
    field_at = np.array([0, *itertools.accumulate(len(f) for f in fields)], dtype=np.int64) + words
    buf = np.zeros(int(field_at[-1]) + 8, dtype=np.uint8)
    buf[: len(unary)] = np.frombuffer(unary, dtype=np.uint8)
    for f, at in zip(fields, field_at[:-1].tolist(), strict=True):
        buf[at : at + len(f)] = np.frombuffer(f, dtype=np.uint8)
    sizes = np.array(counts, dtype=np.int64)
    unary_bits, complete = _group_starts(buf[:words], sizes)
    if not complete:
        raise PatchError("patch is truncated or corrupted (too few coded values)")
    return RiceGroups(buf, unary_bits, field_at[:-1] * 8, np.array(ks, dtype=np.int64), sizes)


def encode_index_sets(w: Writer, sets: Sequence[np.ndarray]) -> None:
    """Strictly increasing int64 position sets as Rice-coded gaps (`p_j - p_{j-1} - 1`)."""
    w.extend(written(put_index_sets, *_joined(sets, np.int64)))


def decode_index_sets(r: Reader, counts: Sequence[int], limits: Sequence[int]) -> list[np.ndarray]:
    """Position sets written by `encode_index_sets`, each checked to lie in [0, limit)."""
    g = rice_groups(r, counts)
    sets = [
        _set_indices(g.buf, g.unary_bits[i], g.field_bits[i], g.ks[i], n, limit)
        for i, (n, limit) in enumerate(zip(counts, limits, strict=True))
    ]
    if any(s.size != n for s, n in zip(sets, counts, strict=True)):
        raise PatchError("corrupted patch: a position lies outside its range")
    return sets
