"""The codec's public planning contract (`codec.plan_thresholds` and its helpers) is what
the encoder itself does: a second implementation that follows it step by step (as the
publisher's device diff does) gets the encoder's own `ContextHint`, and a patch made
with that hint is byte-identical to one made without it."""

from __future__ import annotations

from unittest import mock

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.board import codec
from deltaboard.board.codec import context, ranked
from tests.board.codec_cases import PATTERNS, Case, make_case

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SAMPLED = (1 << 16) + 37  # large enough to be sampled (checked below)


def planned_hint(changes: codec.Changes, old_bits: np.ndarray) -> codec.ContextHint | None:
    """The planning contract stated in `codec.plan_thresholds`, step by step, from the
    codec's public names and plain numpy only (no codec kernel): what a device
    implementation computes."""
    if changes.dtype not in codec.EXPONENT_FIELDS or not changes.count:
        return None
    shift, mask = codec.EXPONENT_FIELDS[changes.dtype]
    exponents = ((old_bits >> old_bits.dtype.type(shift)) & old_bits.dtype.type(mask)).astype(np.int64)
    sampled = np.bincount(exponents[:: codec.sample_stride(old_bits.size)], minlength=mask + 1)
    changed = np.bincount(exponents[changes.positions], minlength=mask + 1)
    plan = codec.plan_thresholds(sampled, changed, old_bits.size)
    if plan is None:
        return None
    low, top = codec.class_limits(changes.dtype, *plan)
    sign_less = old_bits & old_bits.dtype.type((1 << (8 * old_bits.itemsize - 1)) - 1)
    classes = (sign_less >= low).astype(np.int64) + (sign_less >= top)
    # rank: members of the element's class before it (inclusive running count, minus itself)
    running = np.stack([np.cumsum(classes == c) for c in range(3)])
    mine = classes[changes.positions]
    return codec.ContextHint(*plan, running[mine, changes.positions] - 1)


def check_contract(case: Case) -> codec.ContextHint | None:
    old_bits = case.old.view(codec.uint_dtype(case.dtype))
    changes = codec.diff(case.old, case.new, case.dtype)
    seen: list[codec.ContextHint | None] = []

    def spy(changes: codec.Changes, old_bits: np.ndarray) -> codec.ContextHint | None:
        hint = real(changes, old_bits)
        seen.append(hint)
        return hint

    real = ranked.context_hint
    with mock.patch.object(ranked, "context_hint", spy):
        plain = codec.encode_changes(changes, case.old, case.dtype)
    internal = seen[0] if seen else None
    want = planned_hint(changes, old_bits)
    assert (want is None) == (internal is None)
    if want is not None and internal is not None:
        assert (want.t_low, want.t_top) == (internal.t_low, internal.t_top)
        assert np.array_equal(want.ranks, internal.ranks)
        public = codec.context_hint(changes, old_bits)
        assert public is not None and np.array_equal(public.ranks, want.ranks)
    assert codec.encode_changes(changes, case.old, case.dtype, hint=want) == plain
    # the device path: the hint and the base digest, no old bytes (only `replace` needs them)
    if codec.read_header(plain).encoding != "replace":
        base = codec.digest(case.old, case.dtype)
        assert codec.encode_changes(changes, None, case.dtype, old_digest=base, hint=want) == plain
    return want


@st.composite
def planning_cases(draw: st.DrawFn) -> Case:
    """Every dtype and change pattern (NaN payloads, -0/+0, inf among the specials), at
    sizes on both sides of a 64-element word and of the sampling threshold."""
    dtype = draw(st.sampled_from(list(codec.WIDTHS)))
    n = draw(st.one_of(st.sampled_from([0, 1, 63, 64, 65, 4097, SAMPLED]), st.integers(0, 3000)))
    pattern = draw(st.sampled_from(PATTERNS))
    return make_case(dtype, n, pattern, draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(planning_cases())
def test_planned_hint_is_the_encoders_and_changes_no_byte(case: Case) -> None:
    check_contract(case)


@pytest.mark.parametrize("dtype", sorted(codec.EXPONENT_FIELDS))
def test_planned_hint_on_sampled_training_like_changes(dtype: str) -> None:
    """The contract where it matters: classes that pay off, on a sampled histogram."""
    assert codec.sample_stride(SAMPLED) > 1
    hints = [check_contract(make_case(dtype, SAMPLED, p, seed)) for p in PATTERNS for seed in (1, 2)]
    if dtype.startswith("F8"):  # random bit patterns: the classes need not pay off
        return
    assert any(h is not None for h in hints)


def test_plan_refuses_counts_of_different_lengths() -> None:
    """The compiled search reads both arrays without bounds checks: counts that do not
    belong to one dtype are refused before it runs."""
    with pytest.raises(ValueError):
        codec.plan_thresholds(np.ones(256, dtype=np.int64), np.ones(512, dtype=np.int64), 1000)


@numba.njit(cache=False)
def _every_pair(all_hist: np.ndarray, changed_hist: np.ndarray) -> tuple[int, int, float, float]:
    """`context.choose_thresholds` without its bounds: every candidate pair priced, in order."""
    size = all_hist.size
    n_all, n_ch, plain, cand = context.candidates(all_hist, changed_hist)
    best, low, top = np.inf, 0, 0
    for i in range(cand.size):
        for j in range(i, cand.size):
            cost = (
                context._cost(n_all, n_ch, 0, int(cand[i]))
                + context._cost(n_all, n_ch, int(cand[i]), int(cand[j]))
                + context._cost(n_all, n_ch, int(cand[j]), size)
            )
            if cost < best:
                best, low, top = cost, cand[i], cand[j]
    return int(low), int(top), best, plain


@st.composite
def histograms(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Exponent counts of a tensor (scaled as a sampled one's may be) and of its changes:
    training-like (a few neighbouring exponents), random, or mirrored (equal costs)."""
    size = draw(st.sampled_from([16, 32, 256, 2048]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["training", "random", "mirrored"]))
    if kind == "random":
        sampled = rng.integers(0, draw(st.sampled_from([2, 50, 10_000])), size)
    else:
        centre, width = int(rng.integers(0, size)), int(rng.integers(1, min(size, 24)))
        sampled = np.zeros(size, dtype=np.int64)
        lo, hi = max(0, centre - width), min(size, centre + width)
        sampled[lo:hi] = rng.integers(1, 5_000, hi - lo)
        if kind == "mirrored":
            sampled[lo:hi] = np.minimum(sampled[lo:hi], sampled[lo:hi][::-1])
    rate = draw(st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]))
    changed = rng.binomial(sampled, rate * rng.random(size) ** 2) if rate < 1 else sampled.copy()
    scale = draw(st.sampled_from([1.0, 32.0, 31.7]))  # a sampled tensor's counts scale up
    return sampled.astype(np.int64) * scale, changed.astype(np.int64)


@settings(max_examples=400, deadline=None)
@given(histograms())
def test_the_bounded_threshold_search_takes_the_pair_every_pair_takes(
    counts: tuple[np.ndarray, np.ndarray],
) -> None:
    """The skips are exact: the same thresholds and costs as pricing every pair, ties included."""
    all_hist, changed_hist = counts
    assert context.choose_thresholds(all_hist, changed_hist) == _every_pair(all_hist, changed_hist)
