"""Pure commit rules (board.rules): no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltaboard.board.contract.errors import BoardError
from deltaboard.board.server.records import HeadRecord, LeaseRecord
from deltaboard.board.server.rules import check_blob_ranges, check_commit, check_manifest_shape
from tests.support.manifests import manifest

NOW = 1000.0


def live(epoch: int) -> LeaseRecord:
    return LeaseRecord(holder="t", epoch=epoch, expires_at=NOW + 60)


def commit_code(m, head: HeadRecord, lease: LeaseRecord | None) -> str | None:
    """What the ledger checks before it asks for blob sizes: the manifest's own rules, then
    the board's state."""
    return code_of(check_manifest_shape, m, "r") or code_of(check_commit, m, head, lease, NOW)


def code_of(fn, *args) -> str | None:
    try:
        fn(*args)
    except BoardError as e:
        return e.code
    return None


@given(
    head=st.one_of(st.none(), st.integers(0, 1000)),
    version=st.integers(0, 1002),
    lease_epoch=st.integers(1, 5),
    epoch=st.integers(0, 6),
)
def test_only_head_plus_one_under_the_current_epoch_commits(head, version, lease_epoch, epoch):
    m = manifest("r", version, epoch, {"w": b"x"})
    record = HeadRecord(version=head, kind=None if head is None else "delta", epoch=lease_epoch)
    code = commit_code(m, record, live(lease_epoch))
    expected_version = 0 if head is None else head + 1
    if epoch != lease_epoch:
        assert code == "StaleEpoch"
    elif version != expected_version:
        assert code == "NotHead"
    else:
        assert code is None


def test_shape_rules():
    head = HeadRecord(epoch=1)
    lease = live(1)
    assert commit_code(manifest("r", 0, 1, {}, kind="delta"), head, lease) == "BadManifest"
    assert commit_code(manifest("s", 0, 1, {}), head, lease) == "BadManifest"
    bad_parent = manifest("r", 3, 1, {}).model_copy(update={"parent": 1})
    assert commit_code(bad_parent, HeadRecord(version=2, epoch=1), lease) == "BadManifest"
    m = manifest("r", 0, 1, {"w": b"a"})
    twice = m.model_copy(update={"tensors": (*m.tensors, *m.tensors)})
    assert commit_code(twice, head, lease) == "BadManifest"
    assert commit_code(manifest("r", 0, 1, {}), head, None) == "NoLease"
    # A lease may be newer than the head's epoch, never older: the head epoch fences too.
    assert commit_code(manifest("r", 0, 1, {}), HeadRecord(epoch=2), lease) == "StaleEpoch"


@pytest.mark.parametrize("expires_at", [0.0, NOW - 1, NOW])
def test_a_released_or_expired_lease_commits_nothing(expires_at):
    lease = LeaseRecord(holder="t", epoch=1, expires_at=expires_at)
    assert commit_code(manifest("r", 0, 1, {}), HeadRecord(epoch=1), lease) == "NoLease"


@given(size=st.integers(0, 100), offset=st.integers(0, 120), length=st.integers(0, 120))
def test_blob_ranges(size, offset, length):
    m = manifest("r", 0, 1, {"w": b"x"})
    entry = m.tensors[0]
    moved = m.model_copy(
        update={
            "tensors": (
                entry.model_copy(
                    update={"blob": entry.blob.model_copy(update={"offset": offset, "length": length})}
                ),
            )
        }
    )
    code = code_of(check_blob_ranges, moved, {entry.blob.sha256: size})
    assert code == (None if offset + length <= size else "BadManifest")
    assert code_of(check_blob_ranges, moved, {}) == "MissingBlobs"


def test_missing_blobs_are_listed():
    m = manifest("r", 0, 1, {"a": b"1", "b": b"2"})
    with pytest.raises(BoardError) as e:
        check_blob_ranges(m, {m.tensors[0].blob.sha256: 1})
    assert e.value.extra["missing"] == [m.tensors[1].blob.sha256]
