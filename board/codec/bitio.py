"""Byte sections and vectorised Rice coding: the codec's only entropy coder.

A payload is a sequence of fields (u64) and length-prefixed byte sections; `Reader` checks
every bound so that truncated or corrupted input raises PatchError, never IndexError.

Rice coding with parameter k writes `v >> k` in unary and the low k bits verbatim. For the
geometric-like gaps between changed positions it is within a few hundredths of a bit of
the entropy when k is chosen from the mean, and, unlike an arithmetic coder, it vectorises:
the unary parts go to one bit stream (q zeros then a one, so the terminators are found with
one `flatnonzero`) and the remainders to another (fixed width), so coding and decoding cost a
handful of numpy passes over the *changed* elements only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from board.codec.errors import PatchError

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


def _be_bytes(values: np.ndarray, nbytes: int) -> np.ndarray:
    """(n, nbytes) big-endian low bytes of uint64 values: unpackbits then yields MSB first."""
    return values.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - nbytes :]


def pack_fixed(values: np.ndarray, k: int) -> bytes:
    """The low k bits of each uint64 value, MSB first, concatenated and packed."""
    if k == 0 or values.size == 0:
        return b""
    nbytes = (k + 7) // 8
    bits = np.unpackbits(_be_bytes(values, nbytes), axis=1)[:, 8 * nbytes - k :]
    return np.packbits(bits.reshape(-1)).tobytes()


def unpack_fixed(data: memoryview | bytes, count: int, k: int) -> np.ndarray:
    """Inverse of `pack_fixed`: `count` k-bit values as uint64."""
    if k == 0 or count == 0:
        return np.zeros(count, dtype=np.uint64)
    if len(data) * 8 < count * k:
        raise PatchError("patch is truncated or corrupted (fixed-width bits missing)")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count * k).reshape(count, k)
    # packbits left-aligns each row: read it as a big-endian word and shift the value down
    packed = np.zeros((count, 8), dtype=np.uint8)
    packed[:, : (k + 7) // 8] = np.packbits(bits, axis=1)
    values: np.ndarray = packed.view(">u8").reshape(-1).astype(np.uint64) >> np.uint64(64 - k)
    return values


def best_k(values: np.ndarray) -> int:
    """The Rice parameter for geometric-like values of this mean (one pass, no search).

    k = ceil(log2(log(phi - 1) / log(mu / (mu + 1)))) is optimal for a geometric
    distribution of mean mu (Kiely 2004); it also bounds the unary part to about two bits
    per value on average whatever the distribution, since sum(v >> k) <= n * mu / 2**k.
    """
    if values.size == 0:
        return 0
    mu = float(values.sum(dtype=np.float64)) / values.size
    if mu <= 0.0:
        return 0
    ratio = math.log(_GOLDEN - 1.0) / math.log1p(-1.0 / (mu + 1.0))
    return max(0, min(63, math.ceil(math.log2(ratio))))


def rice_encode(w: Writer, groups: Sequence[np.ndarray]) -> None:
    """Append groups of uint64 values Rice-coded, each group with its own parameter.

    One unary stream serves all groups, so finding the values costs the numpy calls of one
    group (per-call overhead dominates at patch sizes); each group's remainders follow in
    a section of fixed-width fields.
    """
    arrays = [g.astype(np.uint64, copy=False) for g in groups]
    ks = [best_k(g) for g in arrays]
    for k in ks:
        w.u64(k)
    counts = [g.size for g in arrays]
    values = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.uint64)
    widths = np.repeat(np.array(ks, dtype=np.uint64), counts)
    ends = np.cumsum((values >> widths).astype(np.int64) + 1) - 1
    unary = np.zeros(int(ends[-1]) + 1 if ends.size else 0, dtype=np.uint8)
    unary[ends] = 1
    w.section(np.packbits(unary).tobytes())
    for g, k in zip(arrays, ks, strict=True):
        w.section(pack_fixed(g, k))


def rice_decode(r: Reader, counts: Sequence[int]) -> list[np.ndarray]:
    """Read groups of `counts` Rice-coded values back as uint64 arrays."""
    ks = [r.u64() for _ in counts]
    if any(k > 63 for k in ks):
        raise PatchError(f"corrupted patch: Rice parameters {ks}")
    unary = r.section()
    remainders = [unpack_fixed(r.section(), count, k) for count, k in zip(counts, ks, strict=True)]
    total = sum(counts)
    ends = np.flatnonzero(np.unpackbits(np.frombuffer(unary, dtype=np.uint8)))
    if ends.size < total:
        raise PatchError("patch is truncated or corrupted (too few coded values)")
    q = np.diff(ends[:total], prepend=-1) - 1
    quotients = np.split(q.astype(np.uint64), np.cumsum(counts)[:-1]) if counts else []
    return [(qg << np.uint64(k)) | rg for qg, k, rg in zip(quotients, ks, remainders, strict=True)]


def encode_index_sets(w: Writer, sets: Sequence[np.ndarray]) -> None:
    """Strictly increasing int64 position sets as Rice-coded gaps (`p_j - p_{j-1} - 1`)."""
    rice_encode(w, [np.diff(p, prepend=-1) - 1 for p in sets])


def decode_index_sets(r: Reader, counts: Sequence[int], limits: Sequence[int]) -> list[np.ndarray]:
    """Position sets written by `encode_index_sets`, each checked to lie in [0, limit)."""
    return [positions_from_gaps(g, limit) for g, limit in zip(rice_decode(r, counts), limits, strict=True)]


def positions_from_gaps(gaps: np.ndarray, limit: int) -> np.ndarray:
    """Strictly increasing positions from their gaps, checked to lie in [0, limit)."""
    if gaps.size == 0:
        return np.empty(0, dtype=np.int64)
    # bounding each gap first keeps the sum far from uint64 wrap-around
    if int(gaps.max()) >= limit:
        raise PatchError("corrupted patch: a position lies outside its range")
    positions = np.cumsum(gaps + np.uint64(1), dtype=np.uint64) - np.uint64(1)
    if int(positions[-1]) >= limit:
        raise PatchError("corrupted patch: a position lies outside its range")
    return positions.astype(np.int64)
