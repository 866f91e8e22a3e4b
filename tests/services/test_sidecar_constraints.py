"""The sidecar's version rules, pure: parsing, decisions, sync targets, retry hints."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltaboard.services.sidecar.constraints import (
    ConstraintError,
    Gone,
    Serve,
    SidecarCode,
    VersionConstraint,
    Wait,
    decide,
    next_target,
    parse_constraint,
    retry_after_s,
)
from deltaboard.services.sidecar.proxy import HTTP_STATUS, OUTCOME


def test_body_field_is_parsed_and_removed():
    body = {"prompt": "x", "weight_version": {"min": 3, "max": 5, "wait": 2}}
    constraint, stripped = parse_constraint(body, {})
    assert constraint == VersionConstraint(min=3, max=5, wait_s=2.0)
    assert stripped == {"prompt": "x"}
    assert "weight_version" in body  # the caller's object is not mutated


def test_integer_shorthand_is_exact():
    constraint, _ = parse_constraint({"weight_version": 7}, {})
    assert constraint == VersionConstraint(exact=7)


def test_headers_and_body_merge_field_by_field():
    headers = {"x-weight-version-min": "2", "x-weight-version-max-lag": "1", "x-weight-version-wait": "0.5"}
    constraint, stripped = parse_constraint({"weight_version": {"min": 4}}, headers)
    assert constraint == VersionConstraint(min=4, max_lag=1, wait_s=0.5)
    constraint, stripped = parse_constraint(None, headers)
    assert constraint == VersionConstraint(min=2, max_lag=1, wait_s=0.5)
    assert stripped is None


def test_no_constraint_is_empty():
    constraint, body = parse_constraint({"prompt": "x"}, {})
    assert constraint.empty and body == {"prompt": "x"}
    assert parse_constraint([1, 2], {})[1] == [1, 2]


@pytest.mark.parametrize(
    "field",
    [
        {"exact": -1},
        {"min": "three"},
        {"max": 1.5},
        {"exact": True},
        {"exact": 3, "min": 4},
        {"min": 9, "max": 2},
        {"wait": -1},
        {"wait": "nan"},
        {"latest": 1},
        {"exact": [1]},
    ],
)
def test_malformed_or_contradictory_constraints_are_client_errors(field):
    with pytest.raises(ConstraintError):
        parse_constraint({"weight_version": field}, {})


def test_bad_header_is_a_client_error():
    with pytest.raises(ConstraintError):
        parse_constraint(None, {"x-weight-version-exact": "latest"})


def test_decisions():
    assert decide(VersionConstraint(exact=5), 5, 9) == Serve()
    assert decide(VersionConstraint(exact=5), 3, 9) == Wait(5)
    assert isinstance(decide(VersionConstraint(exact=5), 6, 9), Gone)
    assert decide(VersionConstraint(min=5), 8, 9) == Serve()
    assert decide(VersionConstraint(), None, None) == Wait(0)
    assert decide(VersionConstraint(), 0, None) == Serve()
    assert decide(VersionConstraint(max_lag=2), 7, 9) == Serve()
    assert decide(VersionConstraint(max_lag=2), 6, 9) == Wait(7)
    assert decide(VersionConstraint(min=12), 9, 9) == Wait(12)  # not published yet: may come
    # the head already ran past max + max_lag: nothing can ever satisfy it
    assert isinstance(decide(VersionConstraint(max=5, max_lag=1), 4, 9), Gone)


versions = st.integers(0, 50)
optional = st.none() | versions


@given(optional, optional, optional, optional, optional)
def test_bounds_are_the_tightest_of_the_fields(exact, lo, hi, lag, head):
    constraint = VersionConstraint(exact=exact, min=lo, max=hi, max_lag=lag)
    floor = head - lag if head is not None and lag is not None else None
    lows = [v for v in (exact, lo, floor) if v is not None]
    highs = [v for v in (exact, hi) if v is not None]
    assert constraint.low(head) == (max(lows) if lows else None)
    assert constraint.high() == (min(highs) if highs else None)


@given(optional, optional, optional, optional, optional, versions)
def test_decide_agrees_with_the_bounds(exact, lo, hi, lag, served, extra):
    constraint = VersionConstraint(exact=exact, min=lo, max=hi, max_lag=lag)
    head = served + extra if served is not None else extra
    low, high = constraint.low(head), constraint.high()
    decision = decide(constraint, served, head)
    if low is not None and high is not None and low > high:
        assert isinstance(decision, Gone)
    elif served is None:
        assert isinstance(decision, Wait)
    elif (low is None or served >= low) and (high is None or served <= high):
        assert decision == Serve()
    elif high is not None and served > high:
        assert isinstance(decision, Gone)
    else:
        assert low is not None and decision == Wait(low)


@given(optional, optional, optional, versions, versions)
def test_gone_is_final_as_the_node_moves_forward(exact, lo, hi, served, step):
    """A node never goes back, so once a request is Gone it stays Gone (for a fixed head)."""
    constraint = VersionConstraint(exact=exact, min=lo, max=hi)
    head = served + step
    if isinstance(decide(constraint, served, head), Gone):
        assert isinstance(decide(constraint, served + step, head), Gone)


def test_next_target_stops_at_pinned_versions_below_head():
    assert next_target(3, 9, []) == 9
    assert next_target(3, 9, [(5, 5), (7, 8)]) == 5
    assert next_target(5, 9, [(5, 5), (7, 8)]) == 7
    assert next_target(3, 9, [(5, None)]) == 9  # no upper bound: the head satisfies it
    assert next_target(3, 9, [(12, 12)]) == 9  # not published yet
    assert next_target(9, 9, []) is None
    assert next_target(None, 4, [(2, 2)]) == 2
    assert next_target(None, None, []) is None


def test_retry_after_grows_with_missing_versions():
    assert retry_after_s(5, 5, 5, 0.2, 1.0) == 1
    assert retry_after_s(8, 5, 5, 0.2, 2.0) == 7
    assert retry_after_s(5, 3, 5, 3.5, 1.0) == 4


def test_every_sidecar_code_has_its_status_in_the_proxy():
    assert set(HTTP_STATUS) == set(SidecarCode)
    assert HTTP_STATUS[SidecarCode.WEIGHT_VERSION_NOT_READY] == 409
    assert HTTP_STATUS[SidecarCode.WEIGHT_VERSION_GONE] == 410
    assert set(OUTCOME) <= set(SidecarCode)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"exact": 5}, "version 5"),
        ({"min": 5}, "version 5 or later"),
        ({"max": 5}, "version 5 or earlier"),
        ({"min": 2, "max": 4}, "a version from 2 to 4"),
        ({}, "any version"),
    ],
)
def test_a_refusal_says_what_the_request_accepts_in_words(spec, words):
    assert parse_constraint({"weight_version": spec}, {})[0].words(head=9) == words
