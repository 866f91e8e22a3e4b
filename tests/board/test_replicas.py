"""Several board processes sharing S3 (SeaweedFS) and Redis (Valkey) are one board."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from deltaboard.board.contract.errors import BoardError
from deltaboard.board.contract.schemas import RetentionPolicy
from deltaboard.board.server.api.state import open_store
from deltaboard.board.server.ledger import Ledger
from deltaboard.board.server.settings import Settings
from tests.support.manifests import manifest, publish
from tests.support.servers import BoardServer, S3Server, board_server


@pytest.fixture
def replicas(tmp_path, s3_server: S3Server, redis_server: str) -> Iterator[tuple[BoardServer, BoardServer]]:
    shared = {
        **s3_server.settings(s3_server.make_bucket()),
        "redis": redis_server,
        "redis_namespace": f"t{secrets.token_hex(4)}",
    }
    a = board_server(tmp_path / "a", **shared)
    b = a.replica(tmp_path / "b")
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_long_poll_on_one_replica_wakes_on_commit_at_the_other(replicas):
    a, b = replicas
    ca = a.client(a.publish_token)
    ca.create_run("r")
    epoch = ca.acquire_lease("r", "t").epoch
    publish(ca, "r", 0, epoch, {"w": b"zero" * 100})
    assert b.client().head("r").version == 0
    got: dict[str, object] = {}
    reader = b.client(b.read_token)

    def poll() -> None:
        got["head"] = reader.head("r", after=0, wait=30)

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    publish(ca, "r", 1, epoch, {"w": b"one" * 100})
    t.join(10)
    assert getattr(got["head"], "version", None) == 1
    # What B serves about version 1 (plan, manifest) came through the shared index and store.
    assert [s.version for s in reader.plan("r", from_version=0).steps] == [1]
    assert reader.manifest("r", 1).version == 1


def test_concurrent_commits_across_replicas_have_one_winner(replicas):
    a, b = replicas
    ca, cb = a.client(a.publish_token), b.client(b.publish_token)
    ca.create_run("r")
    epoch = ca.acquire_lease("r", "t").epoch
    publish(ca, "r", 0, epoch, {"w": b"zero"})
    ca.upload_blob("r", b"one")
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def race(i: int) -> None:
        client = (ca, cb)[i % 2]
        barrier.wait()
        try:
            client.commit("r", manifest("r", 1, epoch, {"w": b"one"}, meta={"writer": i}))
            outcomes.append("won")
        except BoardError as e:
            outcomes.append(e.code)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("won") == 1 and set(outcomes) <= {"won", "NotHead"}
    assert ca.head("r").version == cb.head("r").version == 1
    assert ca.manifest("r", 1) == cb.manifest("r", 1)


def test_presigned_upload_and_redirected_download(replicas, tmp_path):
    a, b = replicas
    c = a.client(a.publish_token)
    c.create_run("r")
    data = bytes(range(256)) * 2000
    target = c.upload_target("r", "0" * 64, len(data))
    assert (
        target.url is not None and target.url.startswith("http") and "x-amz-checksum-sha256" in target.headers
    )
    sha = c.upload_blob("r", data)
    reader = b.client(b.read_token)
    r = httpx.get(f"{b.url}/v1/runs/r/blobs/{sha}", headers={"Authorization": f"Bearer {b.read_token}"})
    assert r.status_code == 307 and "Signature" in r.headers["location"]
    assert reader.get_blob("r", sha, 100, 200) == data[100:200]
    assert reader.blob_size("r", sha) == len(data)
    dest = tmp_path / "blob"
    (tmp_path / "blob.part").write_bytes(data[:1000])
    assert reader.download_blob("r", sha, dest).read_bytes() == data
    # The board-proxied upload works on S3 too (for clients that cannot reach the bucket).
    other = b"proxied" * 1000
    proxied = hashlib.sha256(other).hexdigest()
    c._request("PUT", f"/v1/runs/r/blobs/{proxied}", content=other)
    assert reader.get_blob("r", proxied) == other


def test_an_empty_index_is_rebuilt_from_the_store_after_retention(replicas, tmp_path):
    a, _ = replicas
    c = a.client(a.admin_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    publish(c, "r", 0, epoch, {"w": b"zero"})
    publish(c, "r", 1, epoch, {"w": b"one"})
    publish(c, "r", 2, epoch, {"w": b"two"}, kind="full")
    publish(c, "r", 3, epoch, {"w": b"three"})
    report = c.retention("r", RetentionPolicy(keep_last=1, grace_s=0))
    assert report.deleted_manifests == (0, 1) and report.kept_versions == (2, 3) and report.deleted_blobs == 2
    fresh = a.replica(tmp_path / "c", redis_namespace=f"t{secrets.token_hex(4)}").start()
    try:
        reader = fresh.client(fresh.read_token)
        assert reader.head("r").version == 3
        assert [s.version for s in reader.plan("r").steps] == [2, 3]
        assert reader.get_run("r").name == "r"
        with pytest.raises(BoardError) as e:
            reader.manifest("r", 1)
        assert e.value.code == "UnknownVersion"
    finally:
        fresh.stop()


def test_a_commit_that_never_reached_the_index_is_picked_up(replicas):
    a, b = replicas
    c = a.client(a.publish_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    publish(c, "r", 0, epoch, {"w": b"zero"})
    c.upload_blob("r", b"one")
    # A replica that died right after its head CAS: the store has version 1, the index not.
    settings = Settings.model_validate({k[len("DELTABOARD_") :].lower(): v for k, v in a.env.items()})
    Ledger(open_store(settings)).commit("r", manifest("r", 1, epoch, {"w": b"one"}))
    reader = b.client(b.read_token)
    assert reader.head("r", after=0, wait=20).version == 1  # woken by the reconciliation
    assert [s.version for s in reader.plan("r", from_version=0).steps] == [1]
