"""The storage port's contract, on both adapters: a local directory and S3 (a real
SeaweedFS on loopback). Conditional writes are what keep replicas from losing writes."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import httpx
import pytest

from board.settings import Settings
from board.storage import ObjectNotFound, PreconditionFailed, blob_key
from board.storage.local import LocalStore
from board.storage.s3 import S3Store
from tests.support.servers import S3Server


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return s3_store(request.getfixturevalue("s3_server"), tmp_path)


def s3_store(s3: S3Server, tmp_path: Path, prefix: str = "pre/fix") -> S3Store:
    settings = Settings(
        data_dir=tmp_path,
        store=f"s3://{s3.make_bucket()}/{prefix}",
        s3_endpoint=s3.endpoint,
        s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key,
    )
    return S3Store.from_settings(settings)


def test_put_get_stat_list_delete(store, tmp_path):
    with pytest.raises(ObjectNotFound):
        store.get("runs/r/head.json")
    assert store.stat("runs/r/head.json") is None
    etag = store.put("runs/r/head.json", b"{}")
    assert store.get("runs/r/head.json") == (b"{}", etag)
    store.put("runs/r/assets/tok/vocab.json", b"v")
    f = tmp_path / "upload"
    f.write_bytes(b"blob bytes")
    store.put_file("runs/r/blobs/abc", f)
    assert not f.exists()
    assert store.stat("runs/r/blobs/abc").size == 10
    assert [i.key for i in store.list("runs/r/")] == [
        "runs/r/assets/tok/vocab.json",
        "runs/r/blobs/abc",
        "runs/r/head.json",
    ]
    assert [i.key for i in store.list("runs/r/assets/")] == ["runs/r/assets/tok/vocab.json"]
    assert list(store.list("runs/other/")) == []
    store.delete("runs/r/blobs/abc")
    assert store.stat("runs/r/blobs/abc") is None


def test_create_if_absent_and_compare_and_set(store):
    first = store.put("k/head.json", b"1", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put("k/head.json", b"2", if_none_match=True)
    second = store.put("k/head.json", b"2", if_match=first)
    with pytest.raises(PreconditionFailed):
        store.put("k/head.json", b"3", if_match=first)  # stale ETag
    with pytest.raises(PreconditionFailed):
        store.put("k/absent.json", b"3", if_match=second)
    assert store.get("k/head.json")[0] == b"2"


def test_racing_compare_and_set_has_one_winner(store):
    etag = store.put("k/head.json", b"0")
    wins = []
    barrier = threading.Barrier(6)

    def race(i: int) -> None:
        barrier.wait()
        try:
            store.put("k/head.json", str(i).encode(), if_match=etag)
            wins.append(i)
        except PreconditionFailed:
            pass

    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.get("k/head.json")[0] == str(wins[0]).encode()


def test_local_keys_cannot_escape(tmp_path):
    store = LocalStore(tmp_path / "store")
    for key in ("../x", "runs/../../x", "runs//x", ".tmp/x", ""):
        with pytest.raises(ValueError):
            store.put(key, b"x")


def test_presigned_urls(s3_server, tmp_path):
    store = s3_store(s3_server, tmp_path, "p")
    data = b"presigned" * 1000
    sha = hashlib.sha256(data).hexdigest()
    key = blob_key("r", sha)
    presigned = store.presign_upload(key, sha, 60)
    assert presigned is not None
    url, headers = presigned
    # The store itself refuses bytes that do not hash to the signed sha256.
    assert httpx.put(url, content=b"tampered", headers=headers).status_code == 400
    assert store.stat(key) is None
    assert httpx.put(url, content=data, headers=headers).status_code == 200
    get = store.presign_download(key, 60)
    assert get is not None
    assert httpx.get(get).content == data
    assert httpx.get(get, headers={"Range": "bytes=3-8"}).content == data[3:9]
    assert LocalStore(tmp_path / "l").presign_upload(key, sha, 60) is None
