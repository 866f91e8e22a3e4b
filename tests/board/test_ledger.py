"""The commit protocol of board.ledger on a real local store: idempotent retries, fenced
writers' leftovers, fencing in the middle of a commit, racing commits."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import zstandard

from deltaboard.board.contract.errors import BoardError
from deltaboard.board.contract.schemas import LeaseRenew, LeaseRequest, Manifest, RunCreate
from deltaboard.board.server.ledger import Ledger
from deltaboard.board.server.records import encode, packed_manifest
from deltaboard.board.server.retention import select_versions
from deltaboard.board.server.storage import head_key, lease_key, manifest_key
from deltaboard.board.server.storage.local import LocalStore
from tests.support.manifests import manifest


@pytest.fixture
def ledger(tmp_path):
    ledger = Ledger(LocalStore(tmp_path / "store", fsync=False))
    ledger.create_run(RunCreate(name="r"))
    return ledger


def put_blobs(ledger: Ledger, payloads: dict[str, bytes]) -> None:
    for data in payloads.values():
        ledger.store.put(f"runs/r/blobs/{hashlib.sha256(data).hexdigest()}", data)


def lease(ledger: Ledger, holder: str, steal: bool = False) -> int:
    return ledger.acquire_lease("r", LeaseRequest(holder=holder, steal=steal))[0].epoch


def commit(ledger: Ledger, version: int, epoch: int, data: bytes, **kw):
    payloads = {"w": data}
    put_blobs(ledger, payloads)
    return ledger.commit("r", manifest("r", version, epoch, payloads, **kw))


def test_retry_after_a_crash_before_the_head_cas(ledger):
    epoch = lease(ledger, "a")
    commit(ledger, 0, epoch, b"zero")
    m = manifest("r", 1, epoch, {"w": b"one"})
    put_blobs(ledger, {"w": b"one"})
    # The manifest landed, the head did not (and the manifest may not be durable: the
    # local store syncs it only with the head's bytes). Stored as plain JSON, as a board
    # before packed manifests wrote it: the retry still knows it for its own.
    crashed = ledger.store.write_record(manifest_key("r", 1), encode(m), None)
    assert ledger.head("r")[0].version == 0
    head, record = ledger.commit("r", m)
    assert head.version == 1 and record.kind == "delta"
    # The retry rewrote its manifest with the head, so this attempt made it durable.
    stored, tag = ledger.store.read_record(manifest_key("r", 1))
    assert (stored, tag) == (packed_manifest(encode(m)), str(int(crashed) + 1))
    assert ledger.manifest_bytes("r", 1) == encode(m)


def test_manifests_are_stored_packed_and_read_as_json_either_way(ledger):
    """A commit stores its manifest as one zstd frame (a model of many tensors' manifest is
    megabytes of repeating columns, written and synced before the commit answers); reads
    give its JSON, and a plain JSON record (an older board's) as it is."""
    epoch = lease(ledger, "a")
    commit(ledger, 0, epoch, b"zero")
    m = manifest("r", 1, epoch, {"w": b"one"})
    put_blobs(ledger, {"w": b"one"})
    _, record = ledger.commit("r", m)
    stored, _ = ledger.store.read_record(manifest_key("r", 1))
    assert stored.startswith(b"\x28\xb5\x2f\xfd") and zstandard.decompress(stored) == encode(m)
    assert ledger.manifest_bytes("r", 1) == encode(m)
    assert record.manifest_bytes == len(encode(m))  # what a follower reads: the JSON
    plain, tag = ledger.store.read_record(manifest_key("r", 0))
    ledger.store.write_record(manifest_key("r", 0), zstandard.decompress(plain), tag)
    assert Manifest.model_validate_json(ledger.manifest_bytes("r", 0)).version == 0
    assert [r.version for r in ledger.committed_versions("r", 1)] == [0, 1]
    damaged, tag = ledger.store.read_record(manifest_key("r", 1))
    ledger.store.write_record(manifest_key("r", 1), damaged[:-8], tag)
    assert ledger.manifest_bytes("r", 1) == damaged[:-8]  # refused where it is parsed
    assert [r.version for r in ledger.committed_versions("r", 1)] == [0]


class Crashed(BaseException):
    """Injected fault: the process dies here (no `except` of the store catches it)."""


class Crasher:
    """Injected fault: the process dies at the `at`-th call that changes the disk, before
    it (or, `torn`, after writing half of its bytes), and every later call dies too."""

    CALLS = ("write", "pwrite", "replace", "link", "unlink")

    def __init__(self, at: int, torn: bool) -> None:
        self.at, self.torn, self.calls = at, torn, 0

    def arm(self, patch: pytest.MonkeyPatch) -> None:
        for name in self.CALLS:
            patch.setattr(os, name, self.wrap(name, getattr(os, name)))

    def wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls < self.at:
                return real(*args, **kwargs)
            if self.calls == self.at and self.torn and name in ("write", "pwrite"):
                real(args[0], args[1][: len(args[1]) // 2], *args[2:])
            raise Crashed(name)

        return call


def test_a_commit_killed_at_any_step_leaves_the_old_head_or_the_new_one(tmp_path, monkeypatch):
    """Every instant of a commit's write order, in turn (writes also cut in half): the
    store restarted afterwards holds version 0 as head, or version 1 with its manifest
    whole, never a head without its manifest; a retry then commits it."""
    at, finished = 0, False
    while not finished:
        at += 1
        for torn in (False, True):
            root = tmp_path / f"{at}-{torn}"
            ledger = Ledger(LocalStore(root, fsync=False))
            ledger.create_run(RunCreate(name="r"))
            epoch = lease(ledger, "a")
            commit(ledger, 0, epoch, b"zero")
            put_blobs(ledger, {"w": b"one"})
            m = manifest("r", 1, epoch, {"w": b"one"})
            with monkeypatch.context() as patch:
                Crasher(at, torn).arm(patch)
                try:
                    ledger.commit("r", m)
                    finished = True
                except Crashed:
                    pass
            again = Ledger(LocalStore(root, fsync=False))
            head = again.head("r")[0]
            assert head.version in (0, 1), (at, torn)
            if head.version == 0:
                assert again.commit("r", m)[0].version == 1, (at, torn)
            assert again.manifest_bytes("r", 1) == encode(m), (at, torn)
            assert [r.version for r in again.committed_versions("r", 1)] == [0, 1]
    assert at > 5  # the commit's steps were all reached


def test_fenced_writers_leftover_is_replaced(ledger):
    old = lease(ledger, "a")
    commit(ledger, 0, old, b"zero")
    ledger.store.write_record(manifest_key("r", 1), encode(manifest("r", 1, old, {"w": b"stale"})), None)
    new = lease(ledger, "b", steal=True)
    head, _ = commit(ledger, 1, new, b"fresh")
    assert (head.version, head.epoch) == (1, new)
    assert b"stale" not in ledger.manifest_bytes("r", 1)
    # A leftover of the *same* epoch is a concurrent commit: refused, not overwritten.
    ledger.store.write_record(
        manifest_key("r", 2), encode(manifest("r", 2, new, {"w": b"other"}, meta={"x": 1})), None
    )
    with pytest.raises(BoardError) as e:
        commit(ledger, 2, new, b"mine")
    assert e.value.code == "NotHead"


class BeforeCas(LocalStore):
    """Injected fault: `hook` runs once just before the next compare-and-set of `key` (an
    update, not a first write), between the ledger's read of the record and its write."""

    key = head_key("r")
    hook: Callable[[], object] | None = None

    def _set_record(self, key, data, expected, **kw):
        if key == self.key and expected is not None and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return super()._set_record(key, data, expected, **kw)


def test_fencing_in_the_middle_of_a_commit(tmp_path):
    store = BeforeCas(tmp_path / "store", fsync=False)
    ledger = Ledger(store)
    ledger.create_run(RunCreate(name="r"))
    old = lease(ledger, "a")
    commit(ledger, 0, old, b"zero")
    store.hook = lambda: lease(ledger, "b", steal=True)  # another trainer takes the lease
    with pytest.raises(BoardError) as e:
        commit(ledger, 1, old, b"late")
    assert e.value.code == "StaleEpoch"
    head = ledger.head("r")[0]
    assert head.version == 0 and head.epoch == old + 1
    # The new holder commits version 1 over the fenced writer's leftover manifest.
    assert commit(ledger, 1, old + 1, b"new")[0].version == 1


def test_racing_commits_have_one_winner(ledger):
    epoch = lease(ledger, "a")
    commit(ledger, 0, epoch, b"zero")
    put_blobs(ledger, {"w": b"one"})
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        try:
            ledger.commit("r", manifest("r", 1, epoch, {"w": b"one"}, meta={"writer": i}))
            outcomes.append("won")
        except BoardError as e:
            outcomes.append(e.code)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("won") == 1 and set(outcomes) == {"won", "NotHead"}
    assert ledger.head("r")[0].version == 1


@pytest.fixture
def lease_cas(tmp_path) -> tuple[BeforeCas, Ledger]:
    store = BeforeCas(tmp_path / "store", fsync=False)
    store.key = lease_key("r")
    ledger = Ledger(store)
    ledger.create_run(RunCreate(name="r"))
    return store, ledger


def test_a_renewal_raced_by_the_holders_own_renewal_keeps_the_lease(lease_cas):
    """The chaos suite's trainer was fenced ("the lease changed while renewing") with no
    other writer: a renewal that timed out while the store was frozen was sent again, and
    the two ran at once; the one that lost the compare-and-set fenced its own holder."""
    store, ledger = lease_cas
    epoch = lease(ledger, "a")
    store.hook = lambda: ledger.renew_lease("r", LeaseRenew(holder="a", epoch=epoch, ttl_s=30))
    renewed = ledger.renew_lease("r", LeaseRenew(holder="a", epoch=epoch, ttl_s=60))
    assert store.hook is None  # the other renewal ran between the read and the write
    found = ledger.lease("r")
    assert found is not None
    assert (found[0].holder, found[0].epoch, found[0].expires_at) == ("a", epoch, renewed.expires_at)
    commit(ledger, 0, epoch, b"zero")  # still the writer


@pytest.mark.parametrize("step", ["renew", "release"])
def test_a_lease_taken_between_the_read_and_the_write_still_fences(lease_cas, step):
    store, ledger = lease_cas
    old = lease(ledger, "a")
    store.hook = lambda: lease(ledger, "b", steal=True)
    with pytest.raises(BoardError) as e:
        if step == "renew":
            ledger.renew_lease("r", LeaseRenew(holder="a", epoch=old, ttl_s=60))
        else:
            ledger.release_lease("r", "a", old)
    assert e.value.code == "StaleEpoch"
    found = ledger.lease("r")
    assert found is not None and (found[0].holder, found[0].epoch) == ("b", old + 1)


def test_a_release_raced_by_a_renewal_still_releases(lease_cas):
    store, ledger = lease_cas
    epoch = lease(ledger, "a")
    store.hook = lambda: ledger.renew_lease("r", LeaseRenew(holder="a", epoch=epoch, ttl_s=60))
    ledger.release_lease("r", "a", epoch)
    assert lease(ledger, "b") == epoch + 1  # released: another holder takes it without stealing


def test_lease_rules(ledger):
    first = lease(ledger, "a")
    with pytest.raises(BoardError) as e:
        lease(ledger, "b")
    assert e.value.code == "LeaseHeld"
    again = lease(ledger, "a")  # a restarted holder gets a fresh epoch, fencing its old self
    assert again == first + 1
    ledger.release_lease("r", "a", again)
    assert lease(ledger, "b") == again + 1
    with pytest.raises(BoardError):
        ledger.acquire_lease("missing", LeaseRequest(holder="x"))


class SlowBlobChecks(LocalStore):
    """Injected fault: a commit's blob check signals, then stalls, so that a retention pass
    runs between the check and the manifest write."""

    def __init__(self, root, checking: threading.Event) -> None:
        super().__init__(root, fsync=False)
        self.checking = checking

    def stat(self, key):
        info = super().stat(key)
        if "/blobs/" in key and not self.checking.is_set():
            self.checking.set()
            threading.Event().wait(0.5)
        return info


def test_retention_waits_for_a_commit_between_blob_check_and_manifest(tmp_path):
    checking = threading.Event()
    ledger = Ledger(LocalStore(tmp_path / "store", fsync=False))
    ledger.create_run(RunCreate(name="r"))
    epoch = lease(ledger, "a")
    commit(ledger, 0, epoch, b"zero")
    put_blobs(ledger, {"w": b"one"})  # uploaded, idle past the grace period, not yet committed
    versions = {0: ledger.committed_versions("r", 0)[0]}
    ledger.store = SlowBlobChecks(tmp_path / "store", checking)
    outcome: list[object] = []
    m = manifest("r", 1, epoch, {"w": b"one"})
    t = threading.Thread(target=lambda: outcome.append(ledger.commit("r", m)))
    t.start()
    assert checking.wait(10)
    report = ledger.retain(
        "r", versions, 0, select_versions(versions, 0, keep_last=1), grace_s=0.0, touches={}
    )
    t.join(10)
    assert outcome and ledger.head("r")[0].version == 1
    assert report.deleted_blobs == 0
    assert ledger.blob_size("r", hashlib.sha256(b"one").hexdigest()) == 3, "a committed version lost its blob"
