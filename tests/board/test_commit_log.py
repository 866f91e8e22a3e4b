"""The local store's commit log (`storage.commit_log`): a commit acknowledged is never
lost, whatever a kill -9 or a power cut leaves of the files written after the log."""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deltaboard.board.contract.schemas import RunCreate
from deltaboard.board.server.ledger import Ledger
from deltaboard.board.server.records import encode
from deltaboard.board.server.storage import manifest_key
from deltaboard.board.server.storage.local import LocalStore
from tests.board.test_ledger import Crashed, Crasher, lease, put_blobs
from tests.support.manifests import manifest

LOG = 1 << 16  # small logs: their zeros are written at each run's first record


class LogCrasher(Crasher):
    """`Crasher` that also dies at the log's write (`pwritev`), cut in half when torn."""

    def arm(self, patch: pytest.MonkeyPatch) -> None:
        super().arm(patch)
        patch.setattr(os, "pwritev", self.wrap_log_write(os.pwritev))

    def wrap_log_write(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(fd: int, buffers: list[bytes], offset: int, flags: int = 0) -> int:
            self.calls += 1
            if self.calls < self.at:
                return int(real(fd, buffers, offset, flags))
            if self.calls == self.at and self.torn:
                data = b"".join(buffers)
                real(fd, [data[: len(data) // 2]], offset, flags)
            raise Crashed("pwritev")

        return call


def files(root: Path) -> dict[str, bytes]:
    """The store's files but its logs and temporary files, by path."""
    out = {}
    for path in root.rglob("*"):
        relative = path.relative_to(root).as_posix()
        if path.is_file() and not relative.startswith((".commits/", ".tmp/")):
            out[relative] = path.read_bytes()
    return out


def power_cuts(root: Path, synced: dict[str, bytes], into: Path) -> list[Path]:
    """Copies of `root` as a power cut may leave it: each file that changed since it was
    `synced` either as it is now or as it was then (its writes since were not synced);
    the logs as written (their writes were)."""
    now = files(root)
    changed = sorted(k for k in synced.keys() | now.keys() if synced.get(k) != now.get(k))
    cuts = []
    for number, kept in enumerate(itertools.product((True, False), repeat=len(changed))):
        copy = into / f"cut-{number}"
        shutil.copytree(root, copy)
        for key, keep in zip(changed, kept, strict=True):
            if keep:
                continue
            (copy / key).unlink(missing_ok=True)
            if key in synced:
                (copy / key).write_bytes(synced[key])
        cuts.append(copy)
    return cuts


def test_a_commit_acknowledged_survives_a_power_cut_at_any_step(tmp_path, monkeypatch):
    """A commit killed at each disk-changing call of its write order in turn (writes also
    cut in half), then every combination of its files' writes lost: the store opened
    again holds version 0 as head, or version 1 with its manifest whole, and version 1
    whenever the commit had returned; a retry then commits it."""
    at, finished = 0, False
    while not finished:
        at += 1
        for torn in (False, True):
            root = tmp_path / f"{at}-{torn}" / "store"
            ledger = Ledger(LocalStore(root, log_bytes=LOG))
            ledger.create_run(RunCreate(name="r"))
            epoch = lease(ledger, "a")
            put_blobs(ledger, {"w": b"zero"})
            ledger.commit("r", manifest("r", 0, epoch, {"w": b"zero"}))
            put_blobs(ledger, {"w": b"one"})
            ledger = Ledger(LocalStore(root, log_bytes=LOG))  # replayed and synced: the files are durable
            synced = files(root)
            m = manifest("r", 1, epoch, {"w": b"one"})
            acknowledged = False
            with monkeypatch.context() as patch:
                LogCrasher(at, torn).arm(patch)
                try:
                    ledger.commit("r", m)
                    acknowledged = finished = True
                except Crashed:
                    pass
            for cut in power_cuts(root, synced, root.parent):
                where = (at, torn, cut.name)
                again = Ledger(LocalStore(cut, log_bytes=LOG))
                head = again.head("r")[0]
                assert head.version == 1 if acknowledged else head.version in (0, 1), where
                if head.version == 0:
                    assert again.commit("r", m)[0].version == 1, where
                assert again.manifest_bytes("r", 1) == encode(m), where
                assert [r.version for r in again.committed_versions("r", 1)] == [0, 1], where
    assert at > 5  # the commit's steps were all reached


def test_a_log_full_is_checkpointed_and_its_earlier_round_never_replayed(tmp_path):
    """Commits past a log's size start it over (their files synced first); entries of the
    round before, still on the disk after the new round's end, are not the log's: a
    record deleted since (here without the store's knowledge) stays deleted."""
    store = LocalStore(tmp_path, log_bytes=LOG)
    tag, version = None, -1
    log = tmp_path / ".commits"
    first_round = None
    while True:
        version += 1
        # Entries of one size: the new round's first ends where the old round's second began.
        writes = [
            (manifest_key("r", version), b"m" * 3000, None),
            ("runs/r/head.json", b"h%06d" % version, tag),
        ]
        assert store.write_records(writes) == 2
        tag = str(int(tag or 0) + 1)
        (current,) = log.iterdir()
        if first_round is None and version == 3:
            first_round = current.read_bytes()
        if first_round is not None and current.read_bytes()[:100] != first_round[:100]:
            break  # started over: the first entry is the new round's
    store.delete(manifest_key("r", 1))  # named by the first round's second entry only
    again = LocalStore(tmp_path, log_bytes=LOG)
    assert again.stat(manifest_key("r", 1)) is None
    assert again.read_record("runs/r/head.json") == (b"h%06d" % version, tag)
    assert again.get(manifest_key("r", version)) == b"m" * 3000


def test_a_deleted_record_is_not_replayed(tmp_path):
    store = LocalStore(tmp_path, log_bytes=LOG)
    store.write_record("runs/r/manifests/000000000001.json", b"m1", None)
    store.delete_record("runs/r/manifests/000000000001.json")
    assert LocalStore(tmp_path, log_bytes=LOG).read_record("runs/r/manifests/000000000001.json") is None


def test_two_stores_on_one_directory_append_to_one_log(tmp_path):
    """Processes sharing the directory share the run's log: each appends after the other's
    entries (not over them), so that the files lost, the log still sets the last write."""
    a, b = LocalStore(tmp_path, log_bytes=LOG), LocalStore(tmp_path, log_bytes=LOG)
    tag = a.write_record("runs/r/head.json", b"h0", None)
    synced = files(tmp_path)
    for i in range(1, 7):
        writer = a if i % 3 else b
        tag = writer.write_record("runs/r/head.json", b"h" * i, tag)  # entries of every size
    for name, data in synced.items():
        (tmp_path / name).write_bytes(data)  # a power cut lost every file write since
    assert LocalStore(tmp_path, log_bytes=LOG).read_record("runs/r/head.json") == (b"h" * 6, tag)


def test_a_group_too_large_for_its_log_is_synced_where_it_lands(tmp_path, monkeypatch):
    """A manifest over a quarter of its log's size is not logged: its file and folder are
    synced, then the head's slot. Where the log names that manifest (an earlier write),
    the log is synced and emptied first, so that no replay sets the older bytes again."""
    store = LocalStore(tmp_path, log_bytes=LOG)
    tag = store.write_record("runs/r/head.json", b"h0", None)
    synced: list[str] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def recording(real: Callable[[int], None]) -> Callable[[int], None]:
        def call(fd: int) -> None:
            synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).relative_to(tmp_path).as_posix())
            real(fd)

        return call

    monkeypatch.setattr(os, "fsync", recording(real_fsync))
    monkeypatch.setattr(os, "fdatasync", recording(real_fdatasync))
    big = b"x" * (LOG // 2)
    one, two = manifest_key("r", 1), manifest_key("r", 2)
    assert store.write_records([(one, big, None), ("runs/r/head.json", b"h1", tag)]) == 2
    assert sorted(synced[:2]) == sorted([one, "runs/r/manifests"]) and synced[2:] == ["runs/r/head.json"]
    tag, old = (
        store.write_record("runs/r/head.json", b"h2", str(int(tag) + 1)),
        store.write_record(two, b"o", None),
    )
    synced.clear()
    assert store.write_records([(two, big, old), ("runs/r/head.json", b"h3", tag)]) == 2
    # The log's records (the head and the old manifest) and their folders, then as above.
    assert sorted(synced[:4]) == sorted(["runs/r/head.json", "runs/r", two, "runs/r/manifests"])
    assert sorted(synced[4:6]) == sorted([two, "runs/r/manifests"]) and synced[6:] == ["runs/r/head.json"]
    again = LocalStore(tmp_path, log_bytes=LOG)
    assert again.get(two) == big and again.read_record("runs/r/head.json") == (b"h3", str(int(tag) + 1))


def test_records_of_two_runs_are_never_written_together(tmp_path):
    store = LocalStore(tmp_path, log_bytes=LOG)
    with pytest.raises(ValueError):
        store.write_records([("runs/a/head.json", b"a", None), ("runs/b/head.json", b"b", None)])


def test_a_log_being_made_holds_up_no_other_runs_write(tmp_path, monkeypatch):
    """Making a run's log writes its zeros; another run's write meanwhile goes on (a wait
    for the first would end only when the first log's write is let go: out of order)."""
    store = LocalStore(tmp_path, log_bytes=LOG)
    making, release = threading.Event(), threading.Event()
    order: list[str] = []
    real = os.pwrite

    def held(fd: int, data: bytes, offset: int) -> int:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith(".new-") and not making.is_set():
            making.set()
            release.wait(60)
            order.append("run a's log made")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", held)
    first = threading.Thread(target=store.write_record, args=("runs/a/head.json", b"a", None))
    first.start()
    assert making.wait(60)
    store.write_record("runs/b/head.json", b"b", None)
    order.append("run b written")
    release.set()
    first.join()
    assert order == ["run b written", "run a's log made"]
    assert store.read_record("runs/a/head.json") is not None


def test_a_store_closed_cleanly_has_nothing_to_replay(tmp_path):
    """A clean stop syncs the files and empties the logs: what is in the files then (here
    a manifest changed by hand, as tests and operators do) is what the next store reads.
    A store closed still writes (an app started again on it)."""
    store = LocalStore(tmp_path, log_bytes=LOG)
    key = manifest_key("r", 1)
    store.write_record(key, b"m1", None)
    store.close()
    (tmp_path / key).write_bytes(b"by hand")
    again = LocalStore(tmp_path, log_bytes=LOG)
    assert again.get(key) == b"by hand"
    store.write_record(manifest_key("r", 2), b"m2", None)
    store.close()
    assert LocalStore(tmp_path, log_bytes=LOG).get(manifest_key("r", 2)) == b"m2"
