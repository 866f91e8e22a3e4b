"""`codec.plan_thresholds_many` is `codec.plan_thresholds` row by row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deltaboard.board import codec


@st.composite
def count_rows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of exponent counts of one dtype: sampled counts of tensors of both sides of the
    sampling threshold, and changed counts below them that often make the classes pay off."""
    dtype = draw(st.sampled_from(sorted(codec.EXPONENT_FIELDS)))
    bins = codec.EXPONENT_FIELDS[dtype][1] + 1
    rows = draw(st.integers(0, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    numel = rng.choice([1, 100, 5000, 70_000, 1 << 20], size=rows).astype(np.int64)
    sampled = np.zeros((rows, bins), dtype=np.int64)
    changed = np.zeros_like(sampled)
    for i, n in enumerate(numel):
        taken = -(-int(n) // codec.sample_stride(int(n)))
        centre = rng.integers(0, bins)
        exps = np.clip(rng.normal(centre, rng.uniform(0.5, 8), taken).astype(np.int64), 0, bins - 1)
        sampled[i] = np.bincount(exps, minlength=bins)
        picked = exps[rng.random(taken) < rng.choice([0.001, 0.05, 0.5])]
        low = picked[picked < centre] if rng.random() < 0.7 else picked  # changes that favour small values
        changed[i] = np.bincount(low, minlength=bins) * max(1, int(n) // taken)
    return sampled, changed, numel


@settings(max_examples=60, deadline=None)
@given(count_rows())
def test_many_rows_plan_as_each_row_does(rows: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    sampled, changed, numel = rows
    got = codec.plan_thresholds_many(sampled, changed, numel)
    assert got.shape == (numel.size, 2)
    for i in range(numel.size):
        want = codec.plan_thresholds(sampled[i], changed[i], int(numel[i]))
        assert tuple(got[i]) == (want if want is not None else (-1, -1))


@settings(max_examples=8, deadline=None)
@given(count_rows(), st.integers(0, 2**32 - 1))
def test_thousands_of_rows_shared_by_threads_plan_in_order(
    rows: tuple[np.ndarray, np.ndarray, np.ndarray], seed: int
) -> None:
    """Thousands of rows are planned by the codec's threads, a range each: every row's plan
    lands in its own place (rows drawn in a random order, so that a part out of place shows)."""
    sampled, changed, numel = rows
    assume(numel.size > 0)
    want = codec.plan_thresholds_many(sampled, changed, numel)
    order = np.random.default_rng(seed).integers(0, numel.size, 5000)
    got = codec.plan_thresholds_many(sampled[order], changed[order], numel[order])
    assert np.array_equal(got, want[order])


def test_rows_that_do_not_match_are_refused() -> None:
    """The compiled loop reads the rows without bounds checks: mismatched shapes are refused."""
    ones = np.ones((3, 256), dtype=np.int64)
    with pytest.raises(ValueError):
        codec.plan_thresholds_many(ones, np.ones((3, 32), dtype=np.int64), np.ones(3, dtype=np.int64))
    with pytest.raises(ValueError):
        codec.plan_thresholds_many(ones, ones, np.ones(2, dtype=np.int64))
