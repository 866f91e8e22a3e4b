"""New bit patterns coded as ULP steps from the old ones, which the receiver holds.

`d = new - old` as a wrapping signed integer of the element width. For floats of one sign
the bit pattern is monotone in magnitude, so a weight nudged across one rounding boundary
of the view moves by d = +-1, and a weight whose ULP is smaller than the update moves by
about update / ULP, a size its old exponent predicts. The coding, all vectorised:

* the sign of d: one bit per changed element (the update direction is unpredictable);
* the magnitude class c = bit_length(|d| - 1) (0 for one step, 1 for two, 2 for 3-4, ...),
  predicted per old-exponent context (`board.codec.context`) by the most common class of
  that context (a 16-entry table in the patch); the zigzagged misprediction is coded as a
  sparse set of nonzero positions plus Rice-coded sizes, so a well-predicted tensor pays
  a fraction of a bit;
* the c - 1 bits below the leading one of |d| - 1, verbatim (they are nearly uniform),
  grouped by class so that each group is one fixed-width field array.

Every width (1 to 8 bytes) goes through the same uint64 arithmetic, so integer and
NaN-payload tensors are exact too.
"""

from __future__ import annotations

import numpy as np

from board.codec.bitio import (
    Reader,
    Writer,
    pack_fixed,
    positions_from_gaps,
    rice_decode,
    rice_encode,
    unpack_fixed,
)
from board.codec.context import CONTEXTS, value_contexts
from board.codec.dtypes import width
from board.codec.errors import PatchError

_CLASSES = 65  # bit lengths 0..64


def _mask(w: int) -> np.uint64:
    return np.uint64((1 << (8 * w)) - 1)


def steps(old_bits: np.ndarray, new_bits: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
    """(negative?, |d|) of the wrapping difference new - old; |d| >= 1 for changed elements."""
    m = _mask(w)
    d = (new_bits.astype(np.uint64) - old_bits.astype(np.uint64)) & m
    negative = (d >> np.uint64(8 * w - 1)).astype(bool)
    magnitude = np.where(negative, (np.uint64(0) - d) & m, d)
    return negative, magnitude


def bit_length(v: np.ndarray) -> np.ndarray:
    """Bit length of each uint64 (0 for 0), as int64."""
    c = np.frexp(v.astype(np.float64))[1].astype(np.int64)
    # float64 rounding can carry past a power of two for values of 2**53 and more
    big = np.flatnonzero(c > 53)
    if big.size:
        c[big] -= ((v[big] >> (c[big] - 1).astype(np.uint64)) == 0).astype(np.int64)
    return c


def _by_class(c: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(class, indices) for every class >= 2 present, in class order: the low bits of each
    class are packed at that class's fixed width (one section per class)."""
    wide = np.flatnonzero(c >= 2)
    if wide.size == 0:
        return []
    order = wide[np.argsort(c[wide], kind="stable")]
    counts = np.bincount(c[wide], minlength=_CLASSES)
    ends = np.cumsum(counts)
    return [(cls, order[ends[cls] - counts[cls] : ends[cls]]) for cls in np.flatnonzero(counts).tolist()]


def encode_values(w: Writer, old_bits: np.ndarray, new_bits: np.ndarray, dtype: str) -> None:
    negative, magnitude = steps(old_bits, new_bits, width(dtype))
    w.section(np.packbits(negative).tobytes())
    v = magnitude - np.uint64(1)
    c = bit_length(v)
    ctx = value_contexts(old_bits, dtype)
    table = np.bincount(ctx * _CLASSES + c, minlength=CONTEXTS * _CLASSES).reshape(CONTEXTS, _CLASSES)
    predicted = table.argmax(axis=1)
    w.section(predicted.astype(np.uint8).tobytes())
    r = c - predicted[ctx]
    zigzag = ((r << 1) ^ (r >> 63)).astype(np.uint64)
    missed = np.flatnonzero(zigzag)
    w.u64(missed.size)
    rice_encode(w, [np.diff(missed, prepend=-1) - 1, zigzag[missed] - np.uint64(1)])
    for cls, members in _by_class(c):
        w.section(pack_fixed(v[members], cls - 1))


def decode_values(r: Reader, old_bits: np.ndarray, dtype: str) -> np.ndarray:
    """New bit patterns (uint64) for the changed elements whose old bits are given."""
    n = old_bits.size
    signs = r.section()
    if len(signs) * 8 < n:
        raise PatchError("patch is truncated or corrupted (sign bits missing)")
    negative = np.unpackbits(np.frombuffer(signs, dtype=np.uint8), count=n).astype(bool)
    predicted = np.frombuffer(r.section(), dtype=np.uint8).astype(np.int64)
    if predicted.size != CONTEXTS or int(predicted.max()) >= _CLASSES:
        raise PatchError("corrupted patch: bad step-class table")
    missed_count = r.u64()
    if missed_count > n:
        raise PatchError("corrupted patch: more mispredictions than changed elements")
    gaps, sizes = rice_decode(r, [missed_count, missed_count])
    zigzag = np.zeros(n, dtype=np.uint64)
    zigzag[positions_from_gaps(gaps, n)] = sizes + np.uint64(1)
    c = predicted[value_contexts(old_bits, dtype)] + (
        (zigzag >> np.uint64(1)).astype(np.int64) ^ -(zigzag & np.uint64(1)).astype(np.int64)
    )
    if n and (int(c.min()) < 0 or int(c.max()) >= _CLASSES):
        raise PatchError("corrupted patch: step class out of range")
    v = np.zeros(n, dtype=np.uint64)
    v[c == 1] = 1
    for cls, members in _by_class(c):
        v[members] = (np.uint64(1) << np.uint64(cls - 1)) | unpack_fixed(r.section(), members.size, cls - 1)
    m = _mask(width(dtype))
    magnitude = (v + np.uint64(1)) & m
    if n and not bool(magnitude.all()):
        raise PatchError("corrupted patch: a changed element does not change")
    d = np.where(negative, (np.uint64(0) - magnitude) & m, magnitude)
    return (old_bits.astype(np.uint64) + d) & m
