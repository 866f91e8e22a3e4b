"""What both sides know about a changed element before its new value: its old exponent.

A weight's step in ULPs is about (update size) / ULP(old), and ULP(old) is fixed by the old
exponent, so the exponent predicts how far a changed element moved (`values` uses it for
elements whose position is already decoded, on `Changes.old_bits`), and small weights change
far more rarely than large ones: the `context` encoding (`ranked`) codes a changed position
as its rank within one of three classes of the old tensor, `low` (exponent < t_low), `mid`
(t_low <= exponent < t_top) and `top` (the rest). Small weights have small ULPs, so the
classes have very different change rates and coding each one's ranks separately costs
sum_c n_c H(p_c) bits instead of n H(p). Three classes catch most of what a context per
exponent would (measured on the benchmark trajectories).

The thresholds and ranks follow a planning contract that a second implementation of
`context_hint` (the publisher's device diff) reproduces: see `plan_thresholds`.
"""

from __future__ import annotations

import numpy as np

from deltaboard.board.codec.jit import kernel
from deltaboard.board.codec.parallel import map_ranges

# (shift, mask) of the exponent field in each floating dtype's bit pattern.
EXPONENT_FIELDS: dict[str, tuple[int, int]] = {
    "BF16": (7, 0xFF),
    "F16": (10, 0x1F),
    "F32": (23, 0xFF),
    "F64": (52, 0x7FF),
    "F8_E4M3": (3, 0xF),
    "F8_E5M2": (2, 0x1F),
}
CONTEXTS = 16

SAMPLE_STRIDE = 32
SAMPLE_FROM = 1 << 16  # tensors this large are sampled every SAMPLE_STRIDE-th element
CONTEXT_GAIN = 0.9  # use context classes when they estimate <= 90% of the position bits
_LANES = 8  # independent histograms in `_count_every`
_SLACK = 1e-9  # bits an element by which `choose_thresholds` lets its bounds be off


@kernel
def count_exponents(bits: np.ndarray, shift: int, mask: int, stride: int = 1) -> np.ndarray:
    """`exponent_counts` for the exponent field (shift, mask) of `bits[::stride]`, compiled
    (a contiguous array and a stride: a strided view would be read element by element)."""
    if stride == 1:  # a small tensor, counted whole: the hint's largest cost per tensor
        return _count_every(bits, shift, mask)
    counts = np.zeros(mask + 1, dtype=np.int64)
    for i in range(0, bits.size, stride):
        counts[(int(bits[i]) >> shift) & mask] += 1
    return counts


@kernel
def _count_every(bits: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """`count_exponents` of every element, in a loop of unit steps the compiler sees as
    such, into _LANES histograms (the k-th of every _LANES elements counted in lane k):
    neighbouring weights mostly share an exponent, and one histogram would make each
    increment wait for the previous one's store to the same counter."""
    lanes = np.zeros((_LANES, mask + 1), dtype=np.int64)
    i = 0
    while i + _LANES <= bits.size:
        for k in range(_LANES):
            lanes[k, (int(bits[i + k]) >> shift) & mask] += 1
        i += _LANES
    for j in range(i, bits.size):
        lanes[0, (int(bits[j]) >> shift) & mask] += 1
    counts = np.zeros(mask + 1, dtype=np.int64)
    for k in range(_LANES):
        counts += lanes[k]
    return counts


def exponent_counts(bits: np.ndarray, dtype: str) -> np.ndarray:
    """How many of `bits` have each exponent 0..mask of a floating dtype (int64)."""
    counts: np.ndarray = count_exponents(bits, *EXPONENT_FIELDS[dtype])
    return counts


@kernel
def sample_stride(numel: int) -> int:
    """The stride of the old elements whose exponents `plan_thresholds` is given."""
    return SAMPLE_STRIDE if numel >= SAMPLE_FROM else 1


def class_limits(dtype: str, t_low: int, t_top: int) -> tuple[int, int]:
    """(low, top): the sign-less bit patterns below which an element is in class 0, 1."""
    shift = EXPONENT_FIELDS[dtype][0]
    return t_low << shift, t_top << shift


@kernel
def _h(p: float) -> float:
    """Binary entropy in bits, p kept off 0 and 1."""
    q = min(max(p, 1e-12), 1 - 1e-12)
    return float(-(q * np.log2(q) + (1 - q) * np.log2(1 - q)))


@kernel
def _cost(n_all: np.ndarray, n_ch: np.ndarray, a: int, b: int) -> float:
    """Estimated bits for the positions of exponents [a, b) coded as one class."""
    n = max(n_all[b] - n_all[a], 0.0)
    if n <= 0:
        return 0.0
    return float(n * _h(min(max(n_ch[b] - n_ch[a], 0.0) / max(n, 1e-9), 1.0)))


@kernel
def candidates(
    all_hist: np.ndarray, changed_hist: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """What a threshold search prices with (`_cost`): the cumulative counts of all and of
    the changed elements by exponent, the estimated bits without classes, and the
    candidate thresholds (0 and both sides of every exponent that has changes)."""
    size = all_hist.size
    n_all = np.zeros(size + 1)
    n_ch = np.zeros(size + 1)
    for e in range(size):
        n_all[e + 1] = n_all[e] + all_hist[e]
        n_ch[e + 1] = n_ch[e] + np.float64(changed_hist[e])
    plain = n_all[size] * _h(n_ch[size] / max(n_all[size], 1.0))
    marked = np.zeros(size + 1, dtype=np.bool_)
    marked[0] = True
    for e in range(size):
        if changed_hist[e] > 0:
            marked[e] = marked[e + 1] = True
    return n_all, n_ch, plain, np.flatnonzero(marked)


@kernel
def choose_thresholds(all_hist: np.ndarray, changed_hist: np.ndarray) -> tuple[int, int, float, float]:
    """(t_low, t_top, estimated bits with classes, estimated bits without) for positions.

    Only thresholds next to an exponent that has changes can matter, so the search runs
    over those few candidates in one compiled call (the planner runs once per changed
    tensor, so its fixed cost is what a model of many small tensors pays). Of the pairs
    (low, top), the first of equal costs wins, in order of (t_low, t_top).

    Most pairs cannot win, and a pair's middle class costs two logarithms to price (on a
    model of small bf16 tensors ~170 pairs a tensor, which was most of the planner's
    time), so a pair is priced only when a lower bound of its cost is not above the best
    cost found by more than `_SLACK` bits an element. The bounds hold because cutting a
    class in two never costs more (the entropy is concave; its clamp off 0 and 1 breaks
    that by under 1e-10 bits an element, rounding by far less): a middle class costs at
    least the same class cut at every candidate, at least a shorter one of the same row
    plus the rest cut at every candidate, at least the row below's from the next
    candidate plus the first piece. A skipped pair costs more than the best, so the pair
    taken is the one the full search takes.
    """
    size = all_hist.size
    n_all, n_ch, plain, cand = candidates(all_hist, changed_hist)
    total = n_all[size]
    k = cand.size
    below, above = np.empty(k), np.empty(k)
    cut = np.zeros(k)  # cut[j] - cut[i]: [cand[i], cand[j]) as a class between every two
    for i in range(k):
        below[i] = _cost(n_all, n_ch, 0, int(cand[i]))
        above[i] = _cost(n_all, n_ch, int(cand[i]), size)
        if i:
            cut[i] = cut[i - 1] + _cost(n_all, n_ch, int(cand[i - 1]), int(cand[i]))
    slack = _SLACK * (total + 1.0)
    # the middle classes priced in the row below (t_low one candidate up) and in this one
    # (NaN: skipped), rows from the last so that the row below is known
    below_row, row = np.full(k, np.nan), np.full(k, np.nan)
    best, low, top = np.inf, k, k
    for i in range(k - 1, -1, -1):
        row[:] = np.nan
        last = -1  # the longest middle class priced in this row
        for j in range(i, k):
            bound = cut[j] - cut[i]
            if last >= 0:
                bound = max(bound, row[last] + cut[j] - cut[last])
            if j > i and not np.isnan(below_row[j]):
                bound = max(bound, below_row[j] + cut[i + 1] - cut[i])
            if below[i] + bound + above[j] > best + slack:
                continue
            mid = _cost(n_all, n_ch, int(cand[i]), int(cand[j]))
            row[j], last = mid, j
            cost = below[i] + mid + above[j]
            if cost < best or (cost == best and i < low):  # rows last to first: a lower t_low
                best, low, top = cost, i, j
        below_row, row = row, below_row
    return int(cand[low]), int(cand[top]), best, plain


def plan_thresholds(sampled: np.ndarray, changed: np.ndarray, numel: int) -> tuple[int, int] | None:
    """The class thresholds (t_low, t_top) when the classes pay off, else None (code gaps),
    from the exponent counts of the sampled old tensor and of the changed elements' old bits.

    The planning contract (public: `deltaboard.board.codec` exports `EXPONENT_FIELDS`,
    `sample_stride`, `exponent_counts`, `plan_thresholds` and `class_limits`). A second
    implementation of `context_hint` (the publisher's device diff) produces the same
    `ContextHint`, hence the same patch bytes, when it computes, for a tensor of `numel`
    elements of a floating dtype (a key of `EXPONENT_FIELDS`; other dtypes get no hint)
    whose old element bit patterns `old` are unsigned integers of w bits:

    1. each element's exponent `(old >> shift) & mask`, `(shift, mask) = EXPONENT_FIELDS[dtype]`;
    2. `sampled`: the count of each exponent 0..mask over `old[::sample_stride(numel)]`, and
       `changed`: the count of each exponent over the old bits of the changed elements
       (integer arrays of mask + 1 entries, as `exponent_counts` gives);
    3. `plan_thresholds(sampled, changed, numel)`: (t_low, t_top), or None for no hint. It is
       floating-point arithmetic: call this function on the counts, do not reimplement it;
    4. with `(low, top) = class_limits(dtype, t_low, t_top)`, the class of each changed
       position p: 0 if `old[p] & (2**(w - 1) - 1) < low`, else 1 if it is `< top`, else 2
       (the sign-less bit pattern is monotone in |value|); and its rank: how many elements
       of the old tensor before p are in the same class;
    5. `ContextHint(t_low, t_top, ranks)`, the ranks in the order of the changed positions.
    """
    sampled, changed = np.asarray(sampled, dtype=np.int64), np.asarray(changed, dtype=np.int64)
    if sampled.shape != changed.shape or sampled.ndim != 1:  # the compiled search reads both
        raise ValueError(f"exponent counts of one dtype expected, got {sampled.shape} and {changed.shape}")
    t_low, t_top = plan(sampled, changed, numel)
    return None if t_low < 0 else (t_low, t_top)


@kernel
def plan(sampled: np.ndarray, changed: np.ndarray, numel: int) -> tuple[int, int]:
    """`plan_thresholds` on int64 counts, compiled (for the codec's own compiled hint):
    (-1, -1) for None."""
    sampled_numel = -(-numel // sample_stride(numel))
    histogram = sampled * (numel / max(1, sampled_numel))  # the whole tensor's
    t_low, t_top, with_classes, plain = choose_thresholds(histogram, changed)
    return (t_low, t_top) if with_classes <= CONTEXT_GAIN * plain else (-1, -1)


@kernel
def _plan_rows(sampled: np.ndarray, changed: np.ndarray, numel: np.ndarray) -> np.ndarray:
    out = np.empty((numel.size, 2), dtype=np.int64)
    for i in range(numel.size):
        out[i, 0], out[i, 1] = plan(sampled[i], changed[i], numel[i])
    return out


_PLAN_ROWS_MIN = 1024  # rows (~4 us each) from which the codec's threads share the planning


def plan_thresholds_many(sampled: np.ndarray, changed: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """`plan_thresholds` of many tensors of one dtype in one compiled loop: rows of their
    exponent counts (as `plan_thresholds` takes them) and their element counts `numel`;
    a row (t_low, t_top) each, (-1, -1) where the classes do not pay off. The same planner:
    for a second implementation of the contract that hints thousands of small tensors,
    which would pay the call's fixed cost (~6 us) per tensor. Many rows are shared out to
    the codec's threads (`map_ranges`): 20,000 took 87 ms on one core of an H200's host."""
    sampled = np.ascontiguousarray(sampled, dtype=np.int64)
    changed = np.ascontiguousarray(changed, dtype=np.int64)
    numel = np.ascontiguousarray(numel, dtype=np.int64)
    if sampled.shape != changed.shape or sampled.ndim != 2 or numel.shape != sampled.shape[:1]:
        raise ValueError(
            f"rows of exponent counts of one dtype and a numel each expected, got {sampled.shape}, "
            f"{changed.shape} and {numel.shape}"
        )
    parts = map_ranges(
        lambda a, b: _plan_rows(sampled[a:b], changed[a:b], numel[a:b]), numel.size, _PLAN_ROWS_MIN
    )
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
