"""What both sides know about a changed element before its new value: its old exponent.

A weight's step in ULPs is about (update size) / ULP(old), and ULP(old) is fixed by the old
exponent, so the exponent predicts how far a changed element moved (`deltaboard.board.codec.values`
uses it for elements whose position is already decoded, on `Changes.old_bits`), and small
weights change far more rarely than large ones (the position classes below).
"""

from __future__ import annotations

import numpy as np

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


def exponent_of(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The biased exponent of each element (int64); 0 for integer dtypes (one context)."""
    field = EXPONENT_FIELDS.get(dtype)
    if field is None:
        return np.zeros(bits.size, dtype=np.int64)
    shift, mask = field
    e: np.ndarray = ((bits >> bits.dtype.type(shift)) & bits.dtype.type(mask)).astype(np.int64)
    return e


# ---- positions: classes of the old exponent ------------------------------------------
#
# A changed position is coded as its rank within one of three classes of the old tensor:
# `low` (exponent < t_low), `mid` (t_low <= exponent < t_top) and `top` (the rest). Small
# weights have small ULPs, so the classes have very different change rates and coding each
# one's ranks separately costs sum_c n_c H(p_c) bits instead of n H(p). Three classes catch
# most of what a context per exponent would (measured on the benchmark trajectories).
# Both sides compute the classes from the old bits (`deltaboard.board.codec.classes`); the device
# mirror (`deltaboard.publisher.device_diff`) makes the same two `(old & ~sign) < t << shift`
# comparisons and cumulative counts where the tensor lives, from the same sampled histogram.

SAMPLE_STRIDE = 32
SAMPLE_FROM = 1 << 16  # tensors this large are sampled every SAMPLE_STRIDE-th element
CONTEXT_GAIN = 0.9  # use context classes when they estimate <= 90% of the position bits


def sample_stride(numel: int) -> int:
    """The stride of the elements `exponent_histogram` counts."""
    return SAMPLE_STRIDE if numel >= SAMPLE_FROM else 1


def scaled_histogram(counts: np.ndarray, numel: int) -> np.ndarray:
    """Sampled exponent counts scaled to the whole tensor (one definition for every path)."""
    sampled = -(-numel // sample_stride(numel))
    scaled: np.ndarray = counts.astype(np.float64) * (numel / max(1, sampled))
    return scaled


def exponent_histogram(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Counts of each exponent over the tensor (every `sample_stride`-th element, scaled)."""
    mask = EXPONENT_FIELDS[dtype][1]
    sample = bits[:: sample_stride(bits.size)]
    return scaled_histogram(np.bincount(exponent_of(sample, dtype), minlength=mask + 1), bits.size)


def _h(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, 1e-12, 1 - 1e-12)
    return np.asarray(-(q * np.log2(q) + (1 - q) * np.log2(1 - q)))


def choose_thresholds(all_hist: np.ndarray, changed_hist: np.ndarray) -> tuple[int, int, float, float]:
    """(t_low, t_top, estimated bits with classes, estimated bits without) for positions."""
    n_all = np.concatenate([[0.0], np.cumsum(all_hist)])
    n_ch = np.concatenate([[0.0], np.cumsum(changed_hist.astype(np.float64))])
    total, changed = n_all[-1], n_ch[-1]
    plain = float(total * _h(np.array(changed / max(total, 1.0))))
    # only thresholds next to an exponent that has changes can matter
    present = np.flatnonzero(changed_hist > 0)
    cand = np.unique(np.concatenate([[0], present, present + 1]))
    lo, hi = np.meshgrid(cand, cand, indexing="ij")
    ok = lo <= hi

    def cost(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        n = np.maximum(n_all[b] - n_all[a], 0.0)
        k = np.clip(n_ch[b] - n_ch[a], 0.0, None)
        return np.where(n > 0, n * _h(np.minimum(k / np.maximum(n, 1e-9), 1.0)), 0.0)

    zero = np.zeros_like(lo)
    end = np.full_like(lo, all_hist.size)
    costs = cost(zero, lo) + cost(lo, hi) + cost(hi, end)
    costs = np.where(ok, costs, np.inf)
    i, j = np.unravel_index(int(np.argmin(costs)), costs.shape)
    return int(cand[i]), int(cand[j]), float(costs[i, j]), plain


def plan_classes(histogram: np.ndarray, changed_old_bits: np.ndarray, dtype: str) -> tuple[int, int] | None:
    """The class thresholds (t_low, t_top) when classes pay off, else None (code gaps)."""
    changed = np.bincount(exponent_of(changed_old_bits, dtype), minlength=EXPONENT_FIELDS[dtype][1] + 1)
    return plan_from_counts(histogram, changed)


def plan_from_counts(histogram: np.ndarray, changed_counts: np.ndarray) -> tuple[int, int] | None:
    """`plan_classes` from the changed elements' exponent counts (a device counts them)."""
    t_low, t_top, with_classes, plain = choose_thresholds(histogram, changed_counts)
    return (t_low, t_top) if with_classes <= CONTEXT_GAIN * plain else None
