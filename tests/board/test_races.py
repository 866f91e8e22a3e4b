"""Concurrency against a real board process: racing requests must each get a proper answer
(never a 500; the `board` fixture also fails a test whose board logged a traceback) and
leave the board consistent."""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from deltaboard.board.contract.errors import BoardError
from deltaboard.board.contract.schemas import RetentionPolicy
from deltaboard.board.server.storage.local import STALE_TEMP_S
from tests.support.manifests import publish


def test_same_blob_uploaded_and_read_concurrently(board):
    c = board.client(board.publish_token, retries=0)
    c.create_run("r")
    data = bytes(range(256)) * 4096
    sha = hashlib.sha256(data).hexdigest()

    def put(_: int) -> int:
        return httpx.put(
            f"{board.url}/v1/runs/r/blobs/{sha}",
            content=data,
            headers={"Authorization": f"Bearer {board.publish_token}"},
        ).status_code

    def get(_: int) -> int:
        answer = httpx.get(
            f"{board.url}/v1/runs/r/blobs/{sha}", headers={"Authorization": f"Bearer {board.read_token}"}
        )
        assert answer.status_code in (200, 404), answer.text
        assert answer.status_code == 404 or answer.content == data
        return answer.status_code

    with ThreadPoolExecutor(8) as pool:
        gets = [pool.submit(get, i) for i in range(12)]
        puts = list(pool.map(put, range(8)))
        assert puts == [201] * 8
        assert {g.result() for g in gets} <= {200, 404}
    assert c.get_blob("r", sha) == data


def test_blob_reads_racing_retention(board):
    """Retention deletes idle unreferenced blobs while readers fetch them: each read is
    the whole blob or a 404, never a 500."""
    c = board.client(board.publish_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    for v in range(4):
        publish(c, "r", v, epoch, {"w": bytes([v]) * 300_000}, kind="full")
    shas = [hashlib.sha256(bytes([v]) * 300_000).hexdigest() for v in range(4)]
    headers = {"Authorization": f"Bearer {board.read_token}"}

    def read(i: int) -> int:
        sha = shas[i % 3]
        with httpx.Client(headers=headers) as http:
            for _ in range(20):
                answer = http.get(f"{board.url}/v1/runs/r/blobs/{sha}")
                assert answer.status_code in (200, 404), answer.text
                if answer.status_code == 404:
                    return 404
                assert hashlib.sha256(answer.content).hexdigest() == sha
        return 200

    with ThreadPoolExecutor(6) as pool:
        reads = [pool.submit(read, i) for i in range(6)]
        report = board.client().retention("r", RetentionPolicy(keep_last=1, grace_s=0))
        assert {r.result() for r in reads} <= {200, 404}
    assert report.deleted_manifests == (0, 1, 2)
    assert c.get_blob("r", shas[3]) == bytes([3]) * 300_000


def test_lease_renewals_racing_commits_and_steals(board):
    c = board.client(board.publish_token)
    c.create_run("r")
    lease = c.acquire_lease("r", "a")
    publish(c, "r", 0, lease.epoch, {"w": b"x"})

    def renew(_: int) -> str:
        try:
            c.renew_lease("r", "a", lease.epoch)
            return "ok"
        except BoardError as e:
            return e.code

    with ThreadPoolExecutor(6) as pool:
        renewals = [pool.submit(renew, i) for i in range(30)]
        stolen = board.client(board.publish_token).acquire_lease("r", "b", steal=True)
        outcomes = {r.result() for r in renewals}
    assert outcomes <= {"ok", "StaleEpoch"}
    assert stolen.epoch > lease.epoch
    try:
        publish(c, "r", 1, lease.epoch, {"w": b"y"})
        raise AssertionError("a fenced writer committed")
    except BoardError as e:
        assert e.code == "StaleEpoch"


def test_uploads_cut_short_by_a_crash_are_removed_on_start(board):
    board.stop()
    leftover = board.data_dir / "tmp" / "x.upload"
    leftover.write_bytes(b"part of a blob")
    os.utime(leftover, (time.time() - 2 * STALE_TEMP_S,) * 2)
    board.start()
    assert not leftover.exists()
