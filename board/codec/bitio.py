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

import numpy as np

from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import kernel, leading_zeros

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


@kernel
def _word_at(data: np.ndarray, i: int) -> np.uint64:
    """The 8 bytes of `data` from `i` as one big-endian word (one load and a byte swap)."""
    x = np.uint64(0)
    for b in range(8):
        x = (x << np.uint64(8)) | np.uint64(data[i + b])
    return x


@kernel
def _short_field(data: np.ndarray, bit: int, k: int) -> np.uint64:
    """The field of up to 56 bits at bit offset `bit` of `data`, read from the big-endian
    word at its first byte (it fits in that word whatever its bit offset)."""
    return _low_bits(_word_at(data, bit >> 3) >> np.uint64(64 - k - (bit & 7)), k)


@kernel
def read_field(data: np.ndarray, bit: int, k: int) -> np.uint64:
    """The field of 1 to 63 bits at bit offset `bit` of `data`, which holds a word of
    padding past its last field: one word read, two for more than 56 bits."""
    if k <= 56:
        return _short_field(data, bit, k)
    rest = bit + k - 32
    return (_short_field(data, bit, k - 32) << np.uint64(32)) | _short_field(data, rest, 32)


@kernel
def _unpack_fixed(data: np.ndarray, high: np.ndarray, k: int) -> np.ndarray:
    """`high[j] << k` joined with the j-th k-bit field; the caller has checked that `data`
    holds high.size * k bits.

    Fields of up to 56 bits are read each from the big-endian word at its first byte (a
    field then fits in the word whatever its bit offset), from a copy of `data` padded by
    a word: no bit buffer to refill byte by byte; wider fields go through one."""
    out = np.empty(high.size, dtype=np.uint64)
    if k <= 56:
        padded = np.zeros(data.size + 8, dtype=np.uint8)
        padded[: data.size] = data
        for j in range(high.size):
            bit = j * k
            field = _short_field(padded, bit, k)
            out[j] = (high[j] << np.uint64(k)) | field
        return out
    acc = np.uint64(0)
    held = 0
    i = 0
    for j in range(high.size):
        v = high[j]
        left = k
        while left > 0:
            take = min(left, 32)
            left -= take
            while held < take:
                acc = (acc << np.uint64(8)) | np.uint64(data[i])
                i += 1
                held += 8
            held -= take
            v = (v << np.uint64(take)) | _low_bits(acc >> np.uint64(held), take)
        out[j] = v
    return out


def unpack_fixed(data: memoryview | bytes, high: np.ndarray, k: int) -> np.ndarray:
    """The fields of a `put_fixed` section's body joined to known high parts:
    `(high[j] << k) | field_j` as uint64, for as many fields as `high` has values."""
    if len(data) * 8 < high.size * k:
        raise PatchError("patch is truncated or corrupted (fixed-width bits missing)")
    out: np.ndarray = _unpack_fixed(
        np.frombuffer(data, dtype=np.uint8), high.astype(np.uint64, copy=False), k
    )
    return out


@kernel
def _unpack_unary(data: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """(quotients, how many were found): the zeros before each of the first `count` ones.

    A big-endian word at a time (a word of zeros is one step, each one found by a count of
    leading zeros), from a copy of `data` padded with zeros to whole words: the padding
    holds no one, so it adds no quotient."""
    out = np.empty(count, dtype=np.uint64)
    padded = np.zeros(-(-data.size // 8) * 8, dtype=np.uint8)
    padded[: data.size] = data
    found = 0
    zeros = 0
    for w in range(padded.size // 8):
        if found == count:
            break
        x = _word_at(padded, 8 * w)
        if x == 0:
            zeros += 64
            continue
        used = 0
        while x != 0 and found < count:
            lead = int(leading_zeros(x))
            out[found] = zeros + lead
            found += 1
            zeros = 0
            x = (x << np.uint64(lead)) << np.uint64(1)  # lead + 1 may be 64: two shifts
            used += lead + 1
        zeros = 64 - used
    return out, found


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


def rice_decode(r: Reader, counts: Sequence[int]) -> list[np.ndarray]:
    """Read groups of `counts` values Rice-coded by `put_rice` back as uint64 arrays."""
    ks = [r.u64() for _ in counts]
    if any(k > 63 for k in ks):
        raise PatchError(f"corrupted patch: Rice parameters {ks}")
    unary = r.section()
    total = sum(counts)
    if total > len(unary) * 8:
        raise PatchError("patch is truncated or corrupted (too few coded values)")
    q, found = _unpack_unary(np.frombuffer(unary, dtype=np.uint8), total)
    if found < total:
        raise PatchError("patch is truncated or corrupted (too few coded values)")
    quotients = np.split(q, np.cumsum(counts)[:-1]) if counts else []
    return [unpack_fixed(r.section(), qg, k) for qg, k in zip(quotients, ks, strict=True)]


def encode_index_sets(w: Writer, sets: Sequence[np.ndarray]) -> None:
    """Strictly increasing int64 position sets as Rice-coded gaps (`p_j - p_{j-1} - 1`)."""
    w.extend(written(put_index_sets, *_joined(sets, np.int64)))


def decode_index_sets(r: Reader, counts: Sequence[int], limits: Sequence[int]) -> list[np.ndarray]:
    """Position sets written by `encode_index_sets`, each checked to lie in [0, limit)."""
    return [positions_from_gaps(g, limit) for g, limit in zip(rice_decode(r, counts), limits, strict=True)]


@kernel
def _positions(gaps: np.ndarray, limit: int) -> tuple[np.ndarray, bool]:
    out = np.empty(gaps.size, dtype=np.int64)
    p = -1
    for j in range(gaps.size):
        # bounding each gap first keeps the sum far from wrap-around
        if gaps[j] >= np.uint64(limit):
            return out, False
        p += int(gaps[j]) + 1
        if p >= limit:
            return out, False
        out[j] = p
    return out, True


def positions_from_gaps(gaps: np.ndarray, limit: int) -> np.ndarray:
    """Strictly increasing positions from their gaps, checked to lie in [0, limit)."""
    positions, ok = _positions(gaps.astype(np.uint64, copy=False), limit)
    if not ok:
        raise PatchError("corrupted patch: a position lies outside its range")
    out: np.ndarray = positions
    return out
