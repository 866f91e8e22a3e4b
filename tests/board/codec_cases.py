"""Tensor pairs for the codec tests: every dtype, special bit patterns, change patterns.

Data comes from a seeded numpy generator (hypothesis draws the seed, size and pattern),
which keeps examples fast at any size and still shrinks to small failing cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from deltaboard.board import codec

FLOATS = {"BF16", "F16", "F32", "F64"}
# Bit patterns that float comparison gets wrong: +-0, +-inf, NaNs with payloads.
SPECIAL = {
    "BF16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFF81, 0x7F81, 0x0001],
    "F16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7E01, 0xFE01, 0x7C01, 0x0001],
    "F32": [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 0xFFC00123, 0x7F800001, 1],
    "F64": [0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48, 0x7FF8 << 48, (0x7FF8 << 48) | 5, (0xFFF8 << 48) | 77, 1],
    "F8_E4M3": [0x00, 0x80, 0x7F, 0xFF, 0x7E, 0xFE, 0x01],  # no inf: 0x7F/0xFF are NaN
    "F8_E5M2": [0x00, 0x80, 0x7C, 0xFC, 0x7E, 0x7D, 0xFF, 0x01],
}
PATTERNS = (
    "none",
    "all",
    "one",
    "random",
    "ulp",
    "small-weights",
    "many-small-weights",
    "special",
    "stripes",
)


@dataclass(frozen=True)
class Case:
    dtype: str
    old: np.ndarray
    new: np.ndarray


def weights(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """Bit patterns of Gaussian weights (std 0.02) in a float dtype, or random ints."""
    bits = codec.uint_dtype(dtype)
    if dtype == "BF16":
        w = (rng.standard_normal(n) * 0.02).astype(np.float32)
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    if dtype in FLOATS:
        float_type = {"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]
        return (rng.standard_normal(n) * 0.02).astype(float_type).view(bits)
    return rng.integers(0, np.iinfo(bits).max, n, dtype=bits, endpoint=True)


def values(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Float values of bit patterns, as float64."""
    if dtype == "BF16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    float_type = {"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]
    return bits.view(float_type).astype(np.float64)


def make_case(dtype: str, n: int, pattern: str, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    bits = codec.uint_dtype(dtype)
    old = weights(rng, n, dtype)
    new = old.copy()
    if n and pattern == "all":
        new = weights(rng, n, dtype)
        new[new == old] ^= bits.type(1)
    elif n and pattern == "one":
        new[rng.integers(n)] ^= bits.type(1 << int(rng.integers(8 * bits.itemsize)))
    elif n and pattern == "random":
        m = rng.random(n) < rng.choice([0.001, 0.01, 0.1, 0.5])
        new[m] = rng.integers(0, np.iinfo(bits).max, int(m.sum()), dtype=bits, endpoint=True)
    elif n and pattern == "ulp":
        m = rng.random(n) < 0.02
        new[m] += rng.choice(np.array([1, np.iinfo(bits).max, 2, 5], dtype=bits), int(m.sum()))
    elif n and pattern in ("small-weights", "many-small-weights"):
        # like training: small weights (small ULPs) change far more often, by a few ULPs
        if dtype in FLOATS:
            # change probability ~ lr / ULP(w), with ULP(w) ~ |w| / 128 (k steps: k * lr)
            lr = 1e-6 if pattern == "small-weights" else 3e-5
            p = np.clip(lr * 128 / np.maximum(np.abs(values(old, dtype)), 1e-30), 0, 1)
        else:
            p = np.full(n, 0.01)
        m = rng.random(n) < p
        new[m] += rng.integers(1, 4, int(m.sum())).astype(bits)
    elif n and pattern == "stripes":
        # long runs of changed elements: a bitmap beats gap codes
        period = int(rng.integers(2, 9))
        new[(np.arange(n) % period) == 0] ^= bits.type(1)
    elif n and pattern == "special":
        table = np.array(SPECIAL.get(dtype, [0, 1, np.iinfo(bits).max]), dtype=bits)
        old[rng.random(n) < 0.3] = rng.choice(table)
        new = old.copy()
        m = rng.random(n) < 0.3
        new[m] = rng.choice(table, int(m.sum()))
    return Case(dtype, old.view(np.uint8).copy(), new.view(np.uint8).copy())


@st.composite
def cases(draw: st.DrawFn, max_size: int = 5000) -> Case:
    dtype = draw(st.sampled_from(list(codec.WIDTHS)))
    n = draw(st.one_of(st.sampled_from([0, 1, 2, 7, 8, 9, 63]), st.integers(0, max_size)))
    pattern = draw(st.sampled_from(PATTERNS))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_case(dtype, n, pattern, seed)
