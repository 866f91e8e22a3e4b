"""The storage port's contract, on both adapters: a local directory and S3 (a real
SeaweedFS on loopback). Conditional writes are what keep replicas from losing writes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from deltaboard.board.server.settings import Settings
from deltaboard.board.server.storage import ObjectNotFound, PreconditionFailed, blob_key, slots
from deltaboard.board.server.storage.local import STALE_TEMP_S, LocalStore
from deltaboard.board.server.storage.s3 import S3Store
from tests.support.servers import S3Server


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return s3_store(request.getfixturevalue("s3_server"), tmp_path)


def s3_store(s3: S3Server, tmp_path: Path, prefix: str = "pre/fix", public: str | None = None) -> S3Store:
    settings = Settings(
        data_dir=tmp_path,
        store=f"s3://{s3.make_bucket()}/{prefix}",
        s3_endpoint=s3.endpoint,
        s3_public_endpoint=public,
        s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key,
    )
    return S3Store.from_settings(settings)


def test_put_get_stat_list_delete(store, tmp_path):
    with pytest.raises(ObjectNotFound):
        store.get("runs/r/run.json")
    assert store.stat("runs/r/run.json") is None
    store.put("runs/r/run.json", b"{}", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put("runs/r/run.json", b"{2}", if_none_match=True)
    assert store.get("runs/r/run.json") == b"{}"
    store.put("runs/r/assets/tok/vocab.json", b"v")
    f = tmp_path / "upload"
    f.write_bytes(b"blob bytes")
    store.put_file("runs/r/blobs/abc", f)
    assert not f.exists()
    info = store.stat("runs/r/blobs/abc")
    assert info is not None and info.size == 10
    assert [i.key for i in store.list("runs/r/")] == [
        "runs/r/assets/tok/vocab.json",
        "runs/r/blobs/abc",
        "runs/r/run.json",
    ]
    assert [i.key for i in store.list("runs/r/assets/")] == ["runs/r/assets/tok/vocab.json"]
    assert list(store.list("runs/other/")) == []
    store.delete("runs/r/blobs/abc")
    assert store.stat("runs/r/blobs/abc") is None


def test_listing_a_missing_folder_reads_nothing_beside_it(tmp_path, monkeypatch):
    """`GET /v1/runs` lists each run's assets/ folder; a run without one must not cost a
    walk of the whole run (every manifest and blob) in the local store."""
    store = LocalStore(tmp_path / "store")
    store.put("runs/r/manifests/000000000000.json", b"{}")
    walked: list[str] = []
    real_walk = os.walk

    def recording_walk(top: Path) -> object:
        walked.append(Path(top).relative_to(store.root).as_posix())
        return real_walk(top)

    monkeypatch.setattr("deltaboard.board.server.storage.local.os.walk", recording_walk)
    assert list(store.list("runs/r/assets/")) == []
    assert walked == []
    assert [i.key for i in store.list("runs/r/manifests/0000")] == ["runs/r/manifests/000000000000.json"]
    assert walked == ["runs/r/manifests"]


def test_records_compare_and_set(store):
    assert store.read_record("k/head.json") is None
    first = store.write_record("k/head.json", b"1", None)
    with pytest.raises(PreconditionFailed):
        store.write_record("k/head.json", b"2", None)
    second = store.write_record("k/head.json", b"2", first)
    assert store.read_record("k/head.json") == (b"2", second)
    with pytest.raises(PreconditionFailed):
        store.write_record("k/head.json", b"3", first)  # stale tag
    store.write_record("k/head.json", b"3", second)
    with pytest.raises(PreconditionFailed):
        store.write_record("k/head.json", b"4", second)
    store.delete_record("k/head.json")
    assert store.read_record("k/head.json") is None
    assert store.write_record("k/head.json", b"5", None)


def test_write_records_in_order_stops_at_the_first_loser(store):
    tag = store.write_record("k/head.json", b"h0", None)
    assert store.write_records([("k/m/1.json", b"m1", None), ("k/head.json", b"h1", tag)]) == 2
    assert store.read_record("k/m/1.json")[0] == b"m1" and store.read_record("k/head.json")[0] == b"h1"
    # The head changed since `tag`: the manifest lands, the head does not.
    assert store.write_records([("k/m/2.json", b"m2", None), ("k/head.json", b"h2", tag)]) == 1
    assert store.read_record("k/head.json")[0] == b"h1"
    # The manifest slot is taken: nothing after it is written.
    now = store.read_record("k/head.json")[1]
    assert store.write_records([("k/m/2.json", b"other", None), ("k/head.json", b"h3", now)]) == 0
    assert store.read_record("k/m/2.json")[0] == b"m2" and store.read_record("k/head.json") == (b"h1", now)
    assert store.write_records([]) == 0


def race_once(store, expected: str, writers: int = 6) -> list[tuple[int, str]]:
    wins: list[tuple[int, str]] = []
    barrier = threading.Barrier(writers)

    def race(i: int) -> None:
        barrier.wait()
        with contextlib.suppress(PreconditionFailed):
            wins.append((i, store.write_record("k/head.json", str(i).encode(), expected)))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wins


def test_racing_compare_and_set_has_one_winner(store):
    """Several rounds: SeaweedFS's own If-Match lets two writers through now and then."""
    tag = store.write_record("k/head.json", b"0", None)
    for _ in range(5):
        wins = race_once(store, tag)
        assert len(wins) == 1
        winner, tag = wins[0]
        assert store.read_record("k/head.json") == (str(winner).encode(), tag)
    if isinstance(store, S3Store):  # old generations are collected as new ones land
        assert len(list(store.list("k/"))) <= 3


def test_local_keys_cannot_escape(tmp_path):
    store = LocalStore(tmp_path / "store")
    for key in ("../x", "runs/../../x", "runs//x", ".tmp/x", ""):
        with pytest.raises(ValueError):
            store.put(key, b"x")


def test_presigned_urls(s3_server, tmp_path):
    # Clients reach the store by another name than the board does.
    public = s3_server.endpoint.replace("127.0.0.1", "localhost")
    store = s3_store(s3_server, tmp_path, "p", public=public)
    data = b"presigned" * 1000
    sha = hashlib.sha256(data).hexdigest()
    key = blob_key("r", sha)
    presigned = store.presign_upload(key, sha, 60)
    assert presigned is not None
    url, headers = presigned
    assert url.startswith(public)
    # The store itself refuses bytes that do not hash to the signed sha256.
    assert httpx.put(url, content=b"tampered", headers=headers).status_code == 400
    assert store.stat(key) is None
    assert httpx.put(url, content=data, headers=headers).status_code == 200
    get = store.presign_download(key, 60)
    assert get is not None
    assert httpx.get(get).content == data
    assert httpx.get(get, headers={"Range": "bytes=3-8"}).content == data[3:9]
    assert LocalStore(tmp_path / "l").presign_upload(key, sha, 60) is None


def test_local_store_removes_temporary_files_a_crash_left(tmp_path):
    LocalStore(tmp_path)
    old, fresh = tmp_path / ".tmp" / "tmpold", tmp_path / ".tmp" / "tmpfresh"
    old.write_bytes(b"half a record")
    fresh.write_bytes(b"being written by another process")
    os.utime(old, (time.time() - 2 * STALE_TEMP_S,) * 2)
    LocalStore(tmp_path)
    assert not old.exists() and fresh.exists()


def test_local_store_syncs_the_directory_after_each_rename(tmp_path, monkeypatch):
    """A rename is durable only once its directory is synced: every write of a plain
    object does it (records are made durable by their log: `test_commit_log`)."""
    synced: list[Path] = []
    real = LocalStore._sync_file

    def recording(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(LocalStore, "_sync_file", staticmethod(recording))
    store = LocalStore(tmp_path / "store")
    store.put("runs/r/blobs/a", b"x", if_none_match=True)
    store.put("runs/r/assets/b", b"y")
    loose = tmp_path / "upload"
    loose.write_bytes(b"z")
    store.put_file("runs/r/blobs/c", loose)
    run = tmp_path / "store" / "runs" / "r"
    assert synced.count(run / "blobs") == 2  # the create-if-absent link and the moved upload
    assert run / "assets" in synced  # a plain put


def test_local_store_makes_a_commit_durable_in_one_synced_write_of_its_log(tmp_path, monkeypatch):
    """A commit's manifest and head reach the disk in one entry of the run's log, one
    `pwritev` with `RWF_DSYNC`, before either file changes; the files are then set
    without a sync: no fsync, no fdatasync, no directory synced on a commit's way."""
    store = LocalStore(tmp_path / "store")
    tag = store.write_record("runs/r/head.json", b"h0", None)  # the run's log is made
    run = tmp_path / "store" / "runs" / "r"
    calls: list[tuple[str, str, bytes]] = []
    real_pwritev = os.pwritev

    def recording(name: str) -> Callable[..., None]:
        def call(fd: int) -> None:
            calls.append((name, os.readlink(f"/proc/self/fd/{fd}"), slots_of(run / "head.json")))

        return call

    def recording_pwritev(fd: int, buffers: list[bytes], offset: int, flags: int = 0) -> int:
        if flags & os.RWF_DSYNC:
            calls.append(("dsync write", os.readlink(f"/proc/self/fd/{fd}"), slots_of(run / "head.json")))
            assert not (run / "manifests").exists()
        return real_pwritev(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "fsync", recording("fsync"))
    monkeypatch.setattr(os, "fdatasync", recording("fdatasync"))
    monkeypatch.setattr(os, "pwritev", recording_pwritev)
    writes = [("runs/r/manifests/1.json", b"m1", None), ("runs/r/head.json", b"h1", tag)]
    assert store.write_records(writes) == 2
    assert len(calls) == 1 and calls[0][0] == "dsync write" and calls[0][2] == b"h0"
    assert Path(calls[0][1]).parent == tmp_path / "store" / ".commits"
    assert store.read_record("runs/r/head.json") == (b"h1", str(int(tag) + 1))
    assert store.get("runs/r/manifests/1.json") == b"m1"


def slots_of(path: Path) -> bytes:
    """The current record of a slotted file, read without its lock (a test's thread may
    hold it)."""
    current = slots.read(path.read_bytes())
    assert current is not None
    return current.data


def test_a_rewritten_record_keeps_its_file(tmp_path):
    """head.json and lease.json are rewritten in place (the same file, the same size):
    a rename would need its directory synced, a journal commit, on every commit."""
    store = LocalStore(tmp_path)
    tag = store.write_record("runs/r/head.json", b"h0", None)
    path = tmp_path / "runs" / "r" / "head.json"
    before = path.stat()
    for i in range(1, 4):
        tag = store.write_record("runs/r/head.json", b"h%d" % i, tag)
    after = path.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert store.read_record("runs/r/head.json") == (b"h3", tag)
    # A record outgrowing its slots moves to a larger file, then stays in place again.
    big = b"x" * (2 * slots.SLOT_PAGE)
    tag = store.write_record("runs/r/head.json", big, tag)
    assert path.stat().st_ino != before.st_ino and store.read_record("runs/r/head.json") == (big, tag)
    # Manifests stay whole files: retention and listings read them as plain objects.
    store.write_record("runs/r/manifests/000000000001.json", b"m1", None)
    assert store.get("runs/r/manifests/000000000001.json") == b"m1"


def test_a_manifest_is_never_read_as_slots(tmp_path):
    """A manifest's bytes are the publisher's: one holding a valid slot where a slotted
    file's second slot would begin is still read whole."""
    crafted = b"{".ljust(slots.SLOT_PAGE, b" ") + slots.slot(99, b"other", slots.SLOT_PAGE)
    store = LocalStore(tmp_path)
    key = "runs/r/manifests/000000000001.json"
    tag = store.write_record(key, crafted, None)
    assert store.read_record(key) == (crafted, tag) and store.get(key) == crafted


def test_a_record_written_whole_by_an_older_store_is_read_and_then_slotted(tmp_path):
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "head.json").write_bytes(b'{"version": 3}')
    store = LocalStore(tmp_path)
    found = store.read_record("runs/r/head.json")
    assert found is not None and found[0] == b'{"version": 3}'
    tag = store.write_record("runs/r/head.json", b'{"version": 4}', found[1])
    assert slots_of(tmp_path / "runs" / "r" / "head.json") == b'{"version": 4}'
    assert store.read_record("runs/r/head.json") == (b'{"version": 4}', tag)


NEXT = b'{"version": 2}'
WHOLE = 60 + len(NEXT)  # the slot's line and the record: the bytes that must all land


@pytest.mark.parametrize("logged", [True, False])
@pytest.mark.parametrize("cut", [0, 1, 30, 59, 60, 61, WHOLE - 1, WHOLE, slots.SLOT_PAGE - 1])
def test_a_slot_torn_by_a_power_cut_leaves_the_record_old_or_new(tmp_path, monkeypatch, cut, logged):
    """Power lost in the middle of a slot's write leaves any prefix of it on the disk. The
    run's log, written before the slot, sets the new record again; a slot on its own (a
    group too large for its log, here the log taken away) reads as before, under its old
    tag, unless all of the new record's bytes landed (then as written). Either way the
    next write succeeds from the tag read."""
    store = LocalStore(tmp_path)
    # Both slots used; the slot written next holds other bytes where NEXT's last ones go.
    tag = store.write_record("runs/r/head.json", b'{"epoch":7,"version":0}', None)
    tag = store.write_record("runs/r/head.json", b'{"version": 1}', tag)
    path = tmp_path / "runs" / "r" / "head.json"
    real = os.pwrite

    class PowerCut(BaseException):
        pass

    def torn(fd: int, data: bytes, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == str(path):
            real(fd, data[:cut], offset)
            raise PowerCut
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", torn)
    with pytest.raises(PowerCut):
        store.write_record("runs/r/head.json", NEXT, tag)
    monkeypatch.undo()
    if not logged:
        shutil.rmtree(tmp_path / ".commits")
    again = LocalStore(tmp_path)
    found = again.read_record("runs/r/head.json")
    assert found == ((NEXT, str(int(tag) + 1)) if logged or cut >= WHOLE else (b'{"version": 1}', tag))
    assert found is not None
    new = again.write_record("runs/r/head.json", b'{"version": 3}', found[1])
    assert again.read_record("runs/r/head.json") == (b'{"version": 3}', new) and int(new) > int(found[1])


def test_local_store_reads_a_file_whose_size_changed_since_its_stat():
    """One read of the size `fstat` gave is the whole file only while the file keeps that
    size; a file that changed (here one that reports no size at all) is read to its end."""
    status = Path("/proc/self/status")
    assert status.stat().st_size == 0
    data = LocalStore._read_file(status)
    names = [line.split(b":")[0] for line in data.splitlines()]
    assert names == [line.split(b":")[0] for line in status.read_bytes().splitlines()]
