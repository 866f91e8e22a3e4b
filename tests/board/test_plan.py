"""Pure planning (board.plan): the cheapest chain, and clear errors."""

from __future__ import annotations

import hashlib
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltaboard.board.contract.errors import BoardError, UnknownBase
from deltaboard.board.server.plan import plan
from deltaboard.board.server.records import VersionRecord
from deltaboard.board.server.spans import SpanRecord


def rec(v: int, kind: str, **blobs: int) -> VersionRecord:
    return VersionRecord(
        version=v, kind=kind, blobs={hashlib.sha256(k.encode()).hexdigest(): s for k, s in blobs.items()}
    )


def chain(*records: VersionRecord) -> dict[int, VersionRecord]:
    return {r.version: r for r in records}


def test_noop_deltas_and_keyframes():
    versions = chain(
        rec(0, "full", a=1000), rec(1, "delta", b=10), rec(2, "delta", c=10), rec(3, "full", d=100)
    )
    assert plan("r", versions, 3, 3, None).strategy == "noop"
    p = plan("r", versions, 3, 1, 2)
    assert (p.strategy, [s.version for s in p.steps], p.total_bytes) == ("deltas", [2], 10)
    p = plan("r", versions, 3, None, None)  # bootstrap: the nearest keyframe wins
    assert (p.strategy, [s.version for s in p.steps], p.total_bytes) == ("keyframe+deltas", [3], 100)
    p = plan("r", versions, 3, None, 2)
    assert [s.version for s in p.steps] == [0, 1, 2] and p.total_bytes == 1020
    assert p.steps[0].manifest_url == "/v1/runs/r/manifests/0"
    # Going back is possible through a keyframe.
    assert [s.version for s in plan("r", versions, 3, 3, 1).steps] == [0, 1]


def test_shared_blobs_count_once():
    versions = chain(rec(0, "full", a=100), rec(1, "delta", s=50), rec(2, "delta", s=50))
    assert plan("r", versions, 2, 0, 2).total_bytes == 50


def test_errors_name_the_way_out():
    versions = chain(rec(5, "full", a=1), rec(6, "delta", b=1))
    with pytest.raises(UnknownBase) as base:
        plan("r", versions, 6, 2, None)
    assert (base.value.code, base.value.extra["bootstrap"]) == ("UnknownBase", "/v1/runs/r/plan?to=6")
    with pytest.raises(BoardError) as e:
        plan("r", versions, 6, 5, 7)
    assert e.value.code == "UnknownVersion"
    with pytest.raises(BoardError) as e:
        plan("r", {}, None, None, None)
    assert e.value.code == "NoVersions"
    with pytest.raises(BoardError) as e:
        plan("r", chain(rec(6, "delta", b=1)), 6, None, None)
    assert e.value.code == "NoChain"


@st.composite
def histories(draw):
    n = draw(st.integers(1, 12))
    records = [rec(0, "full", **{"k0": draw(st.integers(1, 1000))})]
    for v in range(1, n):
        kind = draw(st.sampled_from(["delta", "delta", "full"]))
        records.append(rec(v, kind, **{f"v{v}": draw(st.integers(0, 1000))}))
    return chain(*records)


@given(histories(), st.data())
def test_plan_is_the_cheapest_valid_chain(versions, data):
    head = max(versions)
    to = data.draw(st.integers(0, head))
    start = data.draw(st.one_of(st.none(), st.integers(0, head)))
    p = plan("r", versions, head, start, to)
    steps = [s.version for s in p.steps]
    if start == to:
        assert p.strategy == "noop" and steps == []
        return
    # A valid chain: contiguous, ending at `to`, starting after `start` or at a keyframe.
    assert steps == list(range(steps[0], to + 1))
    assert steps[0] == (start or 0) + 1 if p.strategy == "deltas" else versions[steps[0]].kind == "full"
    # No valid chain is cheaper.
    costs = []
    candidates = [k for k in versions if versions[k].kind == "full" and k <= to]
    if start is not None and start < to:
        candidates.append(start + 1)
    for first in candidates:
        blobs = dict(itertools.chain.from_iterable(versions[v].blobs.items() for v in range(first, to + 1)))
        costs.append(sum(blobs.values()))
    assert p.total_bytes == min(costs)


def span(a: int, b: int, size: int) -> SpanRecord:
    return SpanRecord(a, b, {hashlib.sha256(f"span{a}-{b}".encode()).hexdigest(): size}, 0)


def test_spans_replace_the_deltas_they_cover_when_cheaper():
    versions = chain(rec(0, "full", k=10_000), *(rec(v, "delta", **{f"d{v}": 100}) for v in range(1, 9)))
    spans = {(s.from_version, s.to_version): s for s in (span(0, 8, 500), span(4, 8, 300), span(0, 4, 350))}
    p = plan("r", versions, 8, 0, None, spans)
    assert (p.strategy, [(s.kind, s.version) for s in p.steps], p.total_bytes) == (
        "spans",
        [("span", 8)],
        500,
    )
    assert p.steps[0].manifest_url == "/v1/runs/r/spans/0/8"
    p = plan("r", versions, 8, 2, None, spans)  # 2 deltas to 4, then the span 4 -> 8
    assert [(s.kind, s.version) for s in p.steps] == [("delta", 3), ("delta", 4), ("span", 8)]
    p = plan("r", versions, 8, 6, None, spans)  # two deltas cost less than any span
    assert (p.strategy, [s.version for s in p.steps]) == ("deltas", [7, 8])
    p = plan("r", versions, 8, None, None, spans)
    assert (p.strategy, [s.version for s in p.steps]) == ("keyframe+spans", [0, 8])
    p = plan("r", versions, 8, 0, 7, spans)  # a span past the target is no use
    assert [(s.kind, s.version) for s in p.steps] == [("span", 4), ("delta", 5), ("delta", 6), ("delta", 7)]


def test_on_equal_bytes_fewer_steps_win():
    versions = chain(rec(0, "full", k=10_000), rec(1, "delta", a=100), rec(2, "delta", b=100))
    p = plan("r", versions, 2, 0, None, {(0, 2): span(0, 2, 200)})
    assert [s.kind for s in p.steps] == ["span"]
    p = plan("r", versions, 2, 0, None, {(0, 2): span(0, 2, 201)})
    assert [s.kind for s in p.steps] == ["delta", "delta"]
