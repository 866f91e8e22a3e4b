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


def pack_varwidth(values: np.ndarray, widths: np.ndarray) -> bytes:
    """The low widths[i] (0..64) bits of each uint64 value, MSB first, concatenated."""
    if values.size == 0:
        return b""
    bits = np.unpackbits(_be_bytes(values, 8), axis=1)
    keep = np.arange(64)[None, :] >= (64 - widths.astype(np.int64))[:, None]
    return np.packbits(bits[keep]).tobytes()


def unpack_varwidth(data: memoryview | bytes, widths: np.ndarray) -> np.ndarray:
    """Inverse of `pack_varwidth` for the given widths."""
    total = int(widths.sum())
    if len(data) * 8 < total:
        raise PatchError("patch is truncated or corrupted (variable-width bits missing)")
    keep = np.arange(64)[None, :] >= (64 - widths.astype(np.int64))[:, None]
    bits = np.zeros((widths.size, 64), dtype=np.uint8)
    bits[keep] = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=total)
    return np.packbits(bits, axis=1).view(">u8").reshape(-1).astype(np.uint64)


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


def rice_encode(w: Writer, values: np.ndarray, k: int | None = None) -> None:
    """Append uint64 `values` Rice-coded (k chosen if not given)."""
    values = values.astype(np.uint64, copy=False)
    if k is None:
        k = best_k(values)
    w.u64(k)
    q = (values >> np.uint64(k)).astype(np.int64)
    ends = np.cumsum(q + 1) - 1
    unary = np.zeros(int(ends[-1]) + 1 if ends.size else 0, dtype=np.uint8)
    unary[ends] = 1
    w.section(np.packbits(unary).tobytes())
    w.section(pack_fixed(values, k))


def rice_decode(r: Reader, count: int) -> np.ndarray:
    """Read `count` Rice-coded values back as uint64."""
    k = r.u64()
    if k > 63:
        raise PatchError(f"corrupted patch: Rice parameter {k}")
    unary = r.section()
    low = r.section()
    ends = np.flatnonzero(np.unpackbits(np.frombuffer(unary, dtype=np.uint8)))
    if ends.size < count:
        raise PatchError("patch is truncated or corrupted (too few coded values)")
    ends = ends[:count]
    q = np.diff(ends, prepend=-1) - 1
    values: np.ndarray = (q.astype(np.uint64) << np.uint64(k)) | unpack_fixed(low, count, k)
    return values


def encode_index_set(w: Writer, positions: np.ndarray) -> None:
    """Strictly increasing int64 positions as Rice-coded gaps (`p_j - p_{j-1} - 1`)."""
    gaps = np.diff(positions, prepend=-1) - 1
    rice_encode(w, gaps.astype(np.uint64))


def decode_index_set(r: Reader, count: int, limit: int) -> np.ndarray:
    """Positions written by `encode_index_set`, checked to lie in [0, limit)."""
    gaps = rice_decode(r, count)
    if count == 0:
        return np.empty(0, dtype=np.int64)
    if int(gaps.max()) >= limit:
        raise PatchError("corrupted patch: a position lies outside the tensor")
    positions = np.cumsum(gaps + np.uint64(1), dtype=np.uint64) - np.uint64(1)
    if int(positions[-1]) >= limit:
        raise PatchError("corrupted patch: a position lies outside the tensor")
    return positions.astype(np.int64)
