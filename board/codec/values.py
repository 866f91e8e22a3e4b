"""New bit patterns coded as ULP steps from the old ones, which the receiver holds.

`d = new - old` as a wrapping signed integer of the element width. For floats of one sign
the bit pattern is monotone in magnitude, so a weight nudged across one rounding boundary
of the view moves by d = +-1, and a weight whose ULP is smaller than the update moves by
about update / ULP, a size its old exponent predicts. The coding (compiled loops over the
changed elements, `deltaboard.board.codec.jit`):

* the sign of d: one bit per changed element (the update direction is unpredictable);
* the magnitude class c = bit_length(|d| - 1) (0 for one step, 1 for two, 2 for 3-4, ...),
  predicted per old-exponent context (`deltaboard.board.codec.context`) by the most common class of
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

from deltaboard.board.codec.bitio import (
    Reader,
    Writer,
    next_index,
    next_value,
    put_fixed,
    put_rice,
    put_section,
    put_u64,
    read_field,
    rice_cursor,
    rice_groups,
)
from deltaboard.board.codec.context import CONTEXTS, EXPONENT_FIELDS
from deltaboard.board.codec.dtypes import width
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import kernel, leading_zeros

_CLASSES = 65  # bit lengths 0..64
_LANES = 4  # histograms of `_classes`


def layout(dtype: str) -> tuple[int, int, np.uint64]:
    """(exponent shift, exponent mask, element mask): mask 0 puts integers in one context."""
    shift, mask = EXPONENT_FIELDS.get(dtype, (0, 0))
    return shift, mask, np.uint64((1 << (8 * width(dtype))) - 1)


@kernel
def _context_base(old: np.ndarray, shift: int, mask: int) -> int:
    """The exponent of context 1 less one: the top CONTEXTS exponents present among the
    changed elements' old bits are kept apart, all smaller ones (tiny weights) lumped
    into context 0."""
    top = 0
    for x in old:
        top = max(top, int(np.uint64(x) >> np.uint64(shift)) & mask)
    return max(0, top - (CONTEXTS - 1))


@kernel
def _context(x: np.generic, shift: int, mask: int, base: int) -> int:
    """The context 0..CONTEXTS-1 of a changed element whose old bits are `x`."""
    return min(max((int(np.uint64(x) >> np.uint64(shift)) & mask) - base, 0), CONTEXTS - 1)


@kernel
def _bit_length(v: np.uint64) -> int:
    return 0 if v == 0 else 64 - int(leading_zeros(v))


@kernel
def _steps(
    old: np.ndarray, new: np.ndarray, shift: int, mask: int, element: np.uint64, work: np.ndarray
) -> tuple[np.ndarray, int]:
    """(sign bits packed MSB first, the step classes' count: classes 0 .. count - 1 occur)
    of the wrapping d = new - old, in one pass that also writes, per changed element,
    |d| - 1, its bit length (the step class) and its context (`_context`) into the rows
    0, 1 and 2 of `work`."""
    n = old.size
    signs = np.zeros((n + 7) // 8, dtype=np.uint8)
    top = (element >> np.uint64(1)) + np.uint64(1)  # the sign bit of the element width
    base = _context_base(old, shift, mask)
    classes = 1
    for i in range(n):
        d = (np.uint64(new[i]) - np.uint64(old[i])) & element
        if d & top:
            signs[i >> 3] |= np.uint8(0x80 >> (i & 7))
            d = (np.uint64(0) - d) & element
        work[0, i] = d - np.uint64(1)
        k = _bit_length(work[0, i])
        work[1, i] = k
        work[2, i] = _context(old[i], shift, mask, base)
        classes = max(classes, k + 1)
    return signs, classes


@kernel
def put_values(
    buf: np.ndarray, at: int, old: np.ndarray, new: np.ndarray, shift: int, mask: int, element: np.uint64
) -> tuple[np.ndarray, int]:
    """The whole coding above in one compiled call, written from `at`: (buffer, end).

    Its fixed cost is what a model of many small tensors pays per patch, so it allocates
    few arrays (one block of rows for every per-element one) and its tables and loops
    by step class cover the classes that occur, not all 65."""
    n = old.size
    # rows: |d| - 1, step class, context; then the misses' gaps and sizes (rows 3-4), and
    # once those are written, the values grouped by class (row 3)
    work = np.empty((5, n), dtype=np.uint64)
    signs, classes = _steps(old, new, shift, mask, element, work)
    v, c, ctx, grouped = work[0], work[1], work[2], work[3]
    buf, at = put_section(buf, at, signs)
    table = np.zeros((CONTEXTS, classes), dtype=np.int64)
    starts = np.zeros(classes + 1, dtype=np.int64)  # elements per class, then where each starts
    # per context the most common class, the first of equals (np.argmax of its row),
    # followed as the rows fill instead of a scan of every row afterwards
    predicted = np.zeros(CONTEXTS, dtype=np.uint8)
    most = np.zeros(CONTEXTS, dtype=np.int64)
    for i in range(n):
        x, k = ctx[i], c[i]
        table[x, k] += 1
        starts[k + 1] += 1
        if table[x, k] > most[x] or (table[x, k] == most[x] and k < predicted[x]):
            most[x] = table[x, k]
            predicted[x] = k
    buf, at = put_section(buf, at, predicted)
    missed = work[3:].reshape(2 * n)  # gaps between misses, then |zigzag| - 1
    m = 0
    last = -1
    for i in range(n):
        r = np.int64(c[i]) - np.int64(predicted[ctx[i]])
        if r:
            missed[m] = i - last - 1
            missed[n + m] = np.uint64((r << 1) ^ (r >> 63)) - np.uint64(1)
            last = i
            m += 1
    buf, at = put_u64(buf, at, m)
    missed[m : 2 * m] = missed[n : n + m]
    buf, at = put_rice(buf, at, missed[: 2 * m], np.array([0, m, 2 * m], dtype=np.int64))
    for k in range(classes):
        starts[k + 1] += starts[k]
    filled = starts[:-1].copy()  # the bits below the leading one, by class
    for i in range(n):
        k = c[i]
        grouped[filled[k]] = v[i]
        filled[k] += 1
    for cls in range(2, classes):
        if starts[cls + 1] > starts[cls]:
            buf, at = put_fixed(buf, at, grouped[starts[cls] : starts[cls + 1]], cls - 1)
    return buf, at


def encode_values(w: Writer, old_bits: np.ndarray, new_bits: np.ndarray, dtype: str) -> None:
    buf, end = put_values(np.zeros(256, dtype=np.uint8), 0, old_bits, new_bits, *layout(dtype))
    w.extend(bytes(buf[:end]))


@kernel
def _misses(
    buf: np.ndarray, unary_bits: np.ndarray, field_bits: np.ndarray, ks: np.ndarray, count: int, n: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(positions of the mispredicted elements, their zigzagged corrections less one, all
    positions in [0, n)), read from their two Rice-coded groups (gaps, sizes: a
    `bitio.RiceGroups`), each array ending with a sentinel for `_classes`: a position past
    every element, a size of 0."""
    at = np.empty(count + 1, dtype=np.int64)
    sizes = np.empty(count + 1, dtype=np.uint64)
    gaps = rice_cursor(buf, unary_bits[0], field_bits[0], ks[0])
    corrections = rice_cursor(buf, unary_bits[1], field_bits[1], ks[1])
    last = -1
    for j in range(count):
        last, gaps = next_index(buf, gaps, last, n)
        if last < 0:
            return at, sizes, False
        at[j] = last
        sizes[j], corrections = next_value(buf, corrections)
    at[count] = n
    sizes[count] = 0
    return at, sizes, True


@kernel
def _classes(
    old: np.ndarray, shift: int, mask: int, predicted: np.ndarray, missed: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(step class per element, elements per class, all in range) from the predictions
    by context and the zigzagged corrections at the missed elements (`missed` and `sizes`
    each end with a sentinel: a position past every element, a size of 0).

    Without branches on the data: a quarter or so of the elements are missed, at random,
    so a branch per miss is mispredicted often; each element adds its correction times
    whether it is the next miss. Classes are counted in _LANES histograms (the i-th
    element in lane i % _LANES), since most elements share class 0 and one histogram
    would make each increment wait for the last one's store."""
    c = np.empty(old.size, dtype=np.uint8)
    lanes = np.zeros((_LANES, _CLASSES), dtype=np.int64)
    base = _context_base(old, shift, mask)
    j = 0
    for i in range(old.size):
        z = sizes[j] + np.uint64(1)
        hit = int(missed[j] == i)
        x = np.int64(predicted[_context(old[i], shift, mask, base)])
        x += (np.int64(z >> np.uint64(1)) ^ -np.int64(z & np.uint64(1))) * hit
        j += hit
        if np.uint64(x) >= np.uint64(_CLASSES):  # negative ones too
            return c, lanes[0], False
        c[i] = x
        lanes[i % _LANES, x] += 1
    counts = lanes[0].copy()
    for lane in range(1, _LANES):
        counts += lanes[lane]
    return c, counts, True


@kernel
def _apply_steps(
    old: np.ndarray,
    c: np.ndarray,
    fields: np.ndarray,
    starts: np.ndarray,
    signs: np.ndarray,
    element: np.uint64,
) -> tuple[np.ndarray, bool]:
    """New bits from the old ones, the step classes, the signs and the bits below each
    leading one (class k's fields, k - 1 bits each, from bit `starts[k]` of `fields`), in
    one pass over the elements; False if a step is zero."""
    new = np.empty(old.size, dtype=old.dtype)
    at = starts.copy()
    for i in range(old.size):
        k = int(c[i])
        if k < 2:  # class 0 is one step (|d| - 1 = 0), class 1 two (|d| - 1 = 1)
            v = np.uint64(k)
        else:
            v = (np.uint64(1) << np.uint64(k - 1)) | read_field(fields, at[k], k - 1)
            at[k] += k - 1
        magnitude = (v + np.uint64(1)) & element
        if magnitude == 0:
            return new, False
        if signs[i >> 3] & (0x80 >> (i & 7)):
            magnitude = (np.uint64(0) - magnitude) & element
        new[i] = (np.uint64(old[i]) + magnitude) & element
    return new, True


def decode_values(r: Reader, old_bits: np.ndarray, dtype: str) -> np.ndarray:
    """New bit patterns (the old bits' dtype) for the changed elements whose old bits are given.

    Two compiled passes over the changed elements: their step classes (prediction and
    corrections), then the new bits (each class's fields read in place from its section,
    in element order, as the encoder grouped them): no sort, gather or scatter by class."""
    n = old_bits.size
    shift, mask, element = layout(dtype)
    signs = r.section()
    if len(signs) * 8 < n:
        raise PatchError("patch is truncated or corrupted (sign bits missing)")
    predicted = np.frombuffer(r.section(), dtype=np.uint8)
    if predicted.size != CONTEXTS or int(predicted.max()) >= _CLASSES:
        raise PatchError("corrupted patch: bad step-class table")
    missed_count = r.u64()
    if missed_count > n:
        raise PatchError("corrupted patch: more mispredictions than changed elements")
    g = rice_groups(r, [missed_count, missed_count])
    missed, sizes, ok = _misses(g.buf, g.unary_bits, g.field_bits, g.ks, missed_count, n)
    if not ok:
        raise PatchError("corrupted patch: a position lies outside its range")
    c, counts, ok = _classes(old_bits, shift, mask, predicted, missed, sizes)
    if not ok:
        raise PatchError("corrupted patch: step class out of range")
    sections, starts = [], np.zeros(_CLASSES, dtype=np.int64)
    at = 0
    for cls in (np.flatnonzero(counts[2:]) + 2).tolist():  # the bits below the leading one (implied)
        section = r.section()
        if len(section) * 8 < int(counts[cls]) * (cls - 1):
            raise PatchError("patch is truncated or corrupted (fixed-width bits missing)")
        sections.append(section)
        starts[cls] = at * 8
        at += len(section)
    fields = np.frombuffer(b"".join([*sections, bytes(8)]), dtype=np.uint8)  # a word of padding
    new, ok = _apply_steps(old_bits, c, fields, starts, np.frombuffer(signs, dtype=np.uint8), element)
    if not ok:
        raise PatchError("corrupted patch: a changed element does not change")
    out: np.ndarray = new
    return out
