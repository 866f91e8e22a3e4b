"""Pure retention selection (board.retention) and its operation on a real local store."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from deltaboard.board.server.records import VersionRecord
from deltaboard.board.server.retention import apply_retention, select_blobs, select_versions
from deltaboard.board.server.spans import SpanRecord
from deltaboard.board.server.storage import blob_key, manifest_key
from deltaboard.board.server.storage.local import LocalStore


@st.composite
def histories(draw):
    n = draw(st.integers(1, 30))
    first = draw(st.integers(0, 5))
    kinds = ["full"] + [draw(st.sampled_from(["delta", "delta", "delta", "full"])) for _ in range(n - 1)]
    return {
        first + i: VersionRecord(version=first + i, kind=k, blobs={f"{first + i:064x}": 1})
        for i, k in enumerate(kinds)
    }


@given(histories(), st.integers(1, 40))
def test_kept_versions_stay_reachable(versions, keep_last):
    head = max(versions)
    sel = select_versions(versions, head, keep_last)
    assert set(sel.keep) | set(sel.delete) == set(versions) and not set(sel.keep) & set(sel.delete)
    assert set(range(max(head - keep_last + 1, min(versions)), head + 1)) <= set(sel.keep)
    # The oldest kept version is a keyframe, or the whole history is kept: every kept version
    # can be bootstrapped from kept manifests only.
    assert versions[min(sel.keep)].kind == "full"
    assert sel.keep == tuple(range(min(sel.keep), head + 1))


def test_blob_selection_respects_references_and_grace():
    last_active = {"a": 0.0, "b": 0.0, "c": 95.0}
    assert select_blobs(last_active, {"a"}, now=100.0, grace_s=10.0) == ("b",)
    assert select_blobs(last_active, set(), now=100.0, grace_s=200.0) == ()


def test_apply_retention_on_a_store(tmp_path):
    store = LocalStore(tmp_path)
    versions = {
        0: VersionRecord(version=0, kind="full", blobs={"a" * 64: 1}),
        1: VersionRecord(version=1, kind="delta", blobs={"b" * 64: 1}),
        2: VersionRecord(version=2, kind="full", blobs={"c" * 64: 1}),
        3: VersionRecord(version=3, kind="delta", blobs={"a" * 64: 1}),  # reuses version 0's blob
    }
    for v, r in versions.items():
        store.put(manifest_key("r", v), b"{}")
        for sha in r.blobs:
            store.put(blob_key("r", sha), b"x")
    store.put(blob_key("r", "d" * 64), b"orphan, fresh")
    sel = select_versions(versions, 3, keep_last=1)
    report = apply_retention(store, "r", versions, 3, sel, grace_s=60.0, touches={}, now=1e12)
    assert report.deleted_manifests == (0, 1) and report.kept_versions == (2, 3)
    left = {i.key.rsplit("/", 1)[-1][:1] for i in store.list("runs/r/blobs/")}
    assert left == {"a", "c"}  # b unreferenced and old; d too (now is far in the future)
    assert [i.key for i in store.list("runs/r/manifests/")] == [manifest_key("r", 2), manifest_key("r", 3)]


def test_spans_kept_only_where_a_kept_versions_plan_takes_them():
    versions = {0: VersionRecord(version=0, kind="full", blobs={"k" * 64: 10_000})}
    versions |= {v: VersionRecord(version=v, kind="delta", blobs={f"{v:064x}": 100}) for v in range(1, 9)}
    versions[2] = VersionRecord(version=2, kind="full", blobs={"f" * 64: 10_000})

    def span(a: int, b: int, size: int) -> SpanRecord:
        return SpanRecord(a, b, {f"{a:032x}{b:032x}": size}, 0)

    spans = {
        (s.from_version, s.to_version): s
        for s in (span(4, 8, 150), span(6, 8, 250), span(1, 3, 120), span(2, 4, 300))
    }
    sel = select_versions(versions, 8, 5, spans)  # keeps 2..8: (1, 3) starts too early
    assert sel.keep == (2, 3, 4, 5, 6, 7, 8)
    assert [(s.from_version, s.to_version) for s in sel.keep_spans] == [(4, 8)]
    assert sorted((s.from_version, s.to_version) for s in sel.delete_spans) == [(1, 3), (2, 4), (6, 8)]
