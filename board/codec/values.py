"""New bit patterns coded as ULP steps from the old ones, which the receiver holds.

`d = new - old` as a wrapping signed integer of the element width. For floats of one sign
the bit pattern is monotone in magnitude, so a weight nudged across one rounding boundary
of the view differs by d = +-1: the common case costs one sign bit plus an "is it more than
one step" flag that is nearly always no. Steps larger than one are *escapes*: their indices
among the changed elements are coded as a sparse set and their sizes Rice-coded. When
escapes are common (many steps apart, pure-bf16 training) a direct Rice code of |d| - 1 is
cheaper; the encoder writes whichever is smaller. Every width (1 to 8 bytes) goes through the
same uint64 arithmetic, so integer and NaN-payload tensors are exact too.
"""

from __future__ import annotations

import numpy as np

from board.codec.bitio import Reader, Writer, decode_index_set, encode_index_set, rice_decode, rice_encode
from board.codec.errors import PatchError

_ESCAPES, _DIRECT = 0, 1


def _mask(width: int) -> np.uint64:
    return np.uint64((1 << (8 * width)) - 1)


def steps(old_bits: np.ndarray, new_bits: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(negative?, |d|) of the wrapping difference new - old; |d| >= 1 for changed elements."""
    m = _mask(width)
    d = (new_bits.astype(np.uint64) - old_bits.astype(np.uint64)) & m
    negative = (d >> np.uint64(8 * width - 1)).astype(bool)
    magnitude = np.where(negative, (np.uint64(0) - d) & m, d)
    return negative, magnitude


def encode_values(w: Writer, old_bits: np.ndarray, new_bits: np.ndarray, width: int) -> None:
    negative, magnitude = steps(old_bits, new_bits, width)
    w.section(np.packbits(negative).tobytes())
    extra = magnitude - np.uint64(1)
    escaped = np.flatnonzero(extra)
    via_escapes = Writer()
    via_escapes.u64(escaped.size)
    encode_index_set(via_escapes, escaped)
    rice_encode(via_escapes, extra[escaped] - np.uint64(1))
    direct = Writer()
    rice_encode(direct, extra)
    a, b = via_escapes.getvalue(), direct.getvalue()
    if len(a) <= len(b):
        w.u64(_ESCAPES)
        w.section(a)
    else:
        w.u64(_DIRECT)
        w.section(b)


def decode_values(r: Reader, old_bits: np.ndarray, width: int) -> np.ndarray:
    """New bit patterns (uint64) for the changed elements whose old bits are given."""
    n = old_bits.size
    signs = r.section()
    if len(signs) * 8 < n:
        raise PatchError("patch is truncated or corrupted (sign bits missing)")
    negative = np.unpackbits(np.frombuffer(signs, dtype=np.uint8), count=n).astype(bool)
    mode = r.u64()
    inner = Reader(r.section())
    if mode == _ESCAPES:
        count = inner.u64()
        if count > n:
            raise PatchError("corrupted patch: more escapes than changed elements")
        escaped = decode_index_set(inner, count, n)
        extra = np.zeros(n, dtype=np.uint64)
        extra[escaped] = rice_decode(inner, count) + np.uint64(1)
    elif mode == _DIRECT:
        extra = rice_decode(inner, n)
    else:
        raise PatchError(f"corrupted patch: unknown value coding {mode}")
    inner.done()
    m = _mask(width)
    magnitude = (extra + np.uint64(1)) & m
    if n and not bool(magnitude.all()):
        raise PatchError("corrupted patch: a changed element does not change")
    d = np.where(negative, (np.uint64(0) - magnitude) & m, magnitude)
    return (old_bits.astype(np.uint64) + d) & m
