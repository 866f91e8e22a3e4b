"""The board's routes end to end against a real board process (local store, embedded index)."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import httpx
import pytest

from deltaboard.board.contract.errors import BoardError
from deltaboard.board.contract.schemas import Heartbeat, RetentionPolicy
from tests.support.manifests import publish


def test_run_assets_and_listing(board):
    c = board.client(board.publish_token)
    info = c.create_run("exp-1", {"model": "tiny"})
    assert (info.name, info.head, info.meta) == ("exp-1", None, {"model": "tiny"})
    assert c.create_run("exp-1").created_at == info.created_at  # idempotent
    c.put_asset("exp-1", "config.json", b'{"a": 1}')
    c.put_asset("exp-1", "tokenizer/vocab.json", b"{}")
    assert c.get_asset("exp-1", "config.json") == b'{"a": 1}'
    assert c.get_run("exp-1").assets == ("config.json", "tokenizer/vocab.json")
    assert [r.name for r in board.client(board.read_token).list_runs()] == ["exp-1"]
    with pytest.raises(BoardError) as e:
        c.get_asset("exp-1", "missing.json")
    assert (e.value.http_status, e.value.code) == (404, "UnknownAsset")


def test_publish_follow_plan(board):
    c = board.client(board.publish_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "trainer").epoch
    full = {"a": b"A" * 5000, "b": b"B" * 5000}
    assert publish(c, "r", 0, epoch, full).version == 0
    for v in range(1, 4):
        publish(c, "r", v, epoch, {"a": bytes([v]) * 100})
    reader = board.client(board.read_token)
    assert reader.head("r").version == 3
    assert reader.manifest("r", 2).version == 2
    plan = reader.plan("r", from_version=1)
    assert plan.strategy == "deltas" and [s.version for s in plan.steps] == [2, 3]
    assert plan.total_bytes == 200
    boot = reader.plan("r")
    assert boot.strategy == "keyframe+deltas" and [s.version for s in boot.steps] == [0, 1, 2, 3]
    assert reader.plan("r", from_version=3).strategy == "noop"
    # A keyframe at 4 is cheaper than replaying 1..4 from 0 when the deltas are big.
    publish(c, "r", 4, epoch, {"a": b"k" * 50}, kind="full")
    assert [s.version for s in reader.plan("r", from_version=0).steps] == [4]


def test_long_poll_wakes_on_commit(board):
    c = board.client(board.publish_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    publish(c, "r", 0, epoch, {"w": b"x" * 10})
    reader = board.client(board.read_token)
    assert reader.head("r", after=0, wait=0.2).version == 0  # times out, returns the head
    got = {}

    def poll():
        got["head"] = reader.head("r", after=0, wait=30)

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    publish(c, "r", 1, epoch, {"w": b"y" * 10})
    t.join(10)
    assert got["head"].version == 1


def test_events_stream(board):
    c = board.client(board.publish_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    seen = []
    ready = threading.Event()

    def listen():
        for head in board.client(board.read_token).events("r"):
            seen.append(head.version)
            ready.set()
            if head.version == 1:
                return

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert ready.wait(10)
    publish(c, "r", 0, epoch, {"w": b"x"})
    publish(c, "r", 1, epoch, {"w": b"y"})
    t.join(10)
    assert seen[0] is None and seen[-1] == 1


def test_blob_range_etag_and_download(board, tmp_path):
    c = board.client(board.publish_token)
    c.create_run("r")
    data = bytes(range(256)) * 4096
    sha = c.upload_blob("r", data)
    assert c.upload_target("r", sha, len(data)).exists  # deduplicated
    assert c.get_blob("r", sha, 10, 20) == data[10:20]
    assert c.blob_size("r", sha) == len(data)
    r = httpx.get(
        f"{board.url}/v1/runs/r/blobs/{sha}", headers={"Authorization": f"Bearer {board.read_token}"}
    )
    assert r.headers["etag"] == f'"{sha}"' and "immutable" in r.headers["cache-control"]
    r = httpx.get(
        f"{board.url}/v1/runs/r/blobs/{sha}",
        headers={"Authorization": f"Bearer {board.read_token}", "If-None-Match": f'"{sha}"'},
    )
    assert r.status_code == 304
    # Resume from a partial file left by an interrupted download.
    dest = tmp_path / "blob"
    (tmp_path / "blob.part").write_bytes(data[:12345])
    c.download_blob("r", sha, dest)
    assert dest.read_bytes() == data
    big = tmp_path / "big.bin"
    big.write_bytes(b"z" * (3 * 2**20 + 7))
    sha_big = c.upload_blob("r", big)
    assert sha_big == hashlib.sha256(big.read_bytes()).hexdigest()
    assert c.blob_size("r", sha_big) == big.stat().st_size


def test_bad_ranges_get_json_errors(board):
    c = board.client(board.publish_token)
    c.create_run("r")
    sha = c.upload_blob("r", b"0123456789")
    url = f"{board.url}/v1/runs/r/blobs/{sha}"
    auth = {"Authorization": f"Bearer {board.read_token}"}
    for header, status, code in (("bytes=10-", 416, "RangeNotSatisfiable"), ("pages=1-2", 400, "BadRange")):
        r = httpx.get(url, headers={**auth, "Range": header})
        assert (r.status_code, r.json()["error"]["code"]) == (status, code)
    r = httpx.get(url, headers={**auth, "Range": "bytes=2-4"})
    assert (r.status_code, r.content) == (206, b"234")


def test_lease_fencing(board):
    c = board.client(board.publish_token)
    c.create_run("r")
    first = c.acquire_lease("r", "trainer-a", ttl_s=30)
    with pytest.raises(BoardError) as e:
        c.acquire_lease("r", "trainer-b")
    assert e.value.code == "LeaseHeld"
    assert c.renew_lease("r", "trainer-a", first.epoch, ttl_s=30).epoch == first.epoch
    second = c.acquire_lease("r", "trainer-b", steal=True)
    assert second.epoch > first.epoch
    with pytest.raises(BoardError) as e:
        publish(c, "r", 0, first.epoch, {"w": b"old"})
    assert (e.value.http_status, e.value.code) == (409, "StaleEpoch")
    with pytest.raises(BoardError) as e:
        c.renew_lease("r", "trainer-a", first.epoch)
    assert e.value.code == "StaleEpoch"
    assert publish(c, "r", 0, second.epoch, {"w": b"new"}).epoch == second.epoch
    c.release_lease("r", "trainer-b", second.epoch)
    third = c.acquire_lease("r", "trainer-c")
    assert third.epoch > second.epoch


def test_fleet_retention_metrics_openapi(board):
    c = board.client(board.admin_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    publish(c, "r", 0, epoch, {"w": b"v0" * 100})
    for v in range(1, 6):
        publish(c, "r", v, epoch, {"w": f"v{v}".encode() * 100})
    publish(c, "r", 6, epoch, {"w": b"k6" * 100}, kind="full")
    publish(c, "r", 7, epoch, {"w": b"v7" * 100})
    orphan = c.upload_blob("r", b"never committed")
    reader = board.client(board.read_token)
    reader.heartbeat("r", Heartbeat(node_id="node-1", version=5, engine="sglang"))
    reader.heartbeat("r", Heartbeat(node_id="node-1", version=7, engine="sglang"))
    nodes = reader.fleet("r")
    assert [(n.node_id, n.version) for n in nodes] == [("node-1", 7)]
    with pytest.raises(BoardError) as e:
        reader.retention("r")
    assert e.value.http_status == 403
    report = c.retention("r", RetentionPolicy(keep_last=1, grace_s=0))
    assert report.kept_versions == (6, 7) and report.deleted_manifests == (0, 1, 2, 3, 4, 5)
    assert report.deleted_blobs == 7  # six old versions' blobs and the orphan
    assert c.blob_size("r", orphan) is None
    with pytest.raises(BoardError) as e:
        reader.plan("r", from_version=3)
    assert e.value.code == "UnknownBase" and "plan?to=7" in e.value.extra["bootstrap"]
    assert [s.version for s in reader.plan("r").steps] == [6, 7]
    with pytest.raises(BoardError) as e:
        reader.manifest("r", 2)
    assert e.value.code == "UnknownVersion"
    text = reader.metrics()
    assert "deltaboard_commits_total 8.0" in text
    assert httpx.get(f"{board.url}/openapi.json").json()["paths"]["/v1/runs/{run}/plan"]


def test_index_rebuilt_from_store_on_restart(board):
    c = board.client(board.publish_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    publish(c, "r", 0, epoch, {"w": b"a" * 10})
    publish(c, "r", 1, epoch, {"w": b"b" * 10})
    board.restart()
    c = board.client(board.publish_token)
    assert c.head("r").version == 1
    assert [s.version for s in c.plan("r").steps] == [0, 1]
    assert publish(c, "r", 2, epoch, {"w": b"c" * 10}).version == 2


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_blob_upload_streams_to_disk(board):
    """A 256 MiB blob passes through a board that never grows by anything near that."""
    c = board.client(board.publish_token)
    c.create_run("r")
    chunk = hashlib.sha256(b"chunk").digest() * 32768  # 1 MiB
    count = 256
    digest = hashlib.sha256()
    for _ in range(count):
        digest.update(chunk)
    sha = digest.hexdigest()
    before = peak_rss_bytes(board.process.pid)
    r = httpx.put(
        f"{board.url}/v1/runs/r/blobs/{sha}",
        content=(chunk for _ in range(count)),
        headers={"Authorization": f"Bearer {board.publish_token}"},
        timeout=120,
    )
    assert r.status_code == 201, r.text
    assert c.blob_size("r", sha) == count * len(chunk)
    assert peak_rss_bytes(board.process.pid) - before < 64 * 2**20


@pytest.mark.parametrize("index", ["embedded", "redis"])
def test_silent_nodes_leave_the_fleet(index, tmp_path, request):
    from tests.support.servers import board_server

    # Each check runs right after the heartbeats it depends on, and a node is gone only
    # after sleeping past the TTL: a busy machine can only make the test slower, not wrong.
    ttl_s = 3.0
    settings = {"fleet_ttl_s": str(ttl_s)}
    if index == "redis":
        settings |= {
            "redis": request.getfixturevalue("redis_server"),
            "redis_namespace": f"fleet{time.time_ns()}",
        }
    server = board_server(tmp_path / "board", **settings).start()
    try:
        c = server.client(server.admin_token)
        c.create_run("r")
        c.heartbeat("r", Heartbeat(node_id="gone", version=None, engine="x"))
        c.heartbeat("r", Heartbeat(node_id="alive", version=None, engine="x"))
        assert [n.node_id for n in c.fleet("r")] == ["alive", "gone"]
        time.sleep(ttl_s + 0.2)  # both silent past the TTL; "alive" speaks again
        c.heartbeat("r", Heartbeat(node_id="alive", version=None, engine="x"))
        assert [n.node_id for n in c.fleet("r")] == ["alive"]
        c.heartbeat("r", Heartbeat(node_id="gone", version=3, engine="x"))  # back after a restart
        assert [(n.node_id, n.version) for n in c.fleet("r")] == [("alive", None), ("gone", 3)]
    finally:
        server.stop()


def test_version_summaries(board):
    """`GET .../versions`: one line per committed version (what the dashboard charts), the
    last `limit` of them, oldest first; the commit latency only from the board that took
    the commit, not after the index was rebuilt from the store."""
    c = board.client(board.publish_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "trainer").epoch
    publish(c, "r", 0, epoch, {"a": b"A" * 5000})
    for v in range(1, 4):
        publish(c, "r", v, epoch, {"a": bytes([v]) * 100})
    publish(c, "r", 4, epoch, {"a": b"k" * 50}, kind="full")
    url = f"{board.url}/v1/runs/r/versions"
    read = {"Authorization": f"Bearer {board.read_token}"}
    summaries = httpx.get(url, headers=read).json()
    assert [(s["version"], s["kind"]) for s in summaries] == [
        (0, "full"),
        (1, "delta"),
        (2, "delta"),
        (3, "delta"),
        (4, "full"),
    ]
    steps = {
        s.version: s for s in board.client(board.read_token).plan("r", from_version=0, to_version=3).steps
    }
    assert summaries[2]["bytes"] == 100 + steps[2].manifest_bytes
    assert all(s["changed_fraction"] == 1.0 and s["commit_s"] > 0 for s in summaries)
    assert [s["version"] for s in httpx.get(url, params={"limit": 2}, headers=read).json()] == [3, 4]
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, params={"limit": 0}, headers=read).status_code == 422
    board.restart()
    rebuilt = httpx.get(url, headers=read).json()
    assert [s["commit_s"] for s in rebuilt] == [None] * 5
    assert [{**s, "commit_s": None} for s in summaries] == rebuilt
