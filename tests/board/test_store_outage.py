"""Issue 11 item 3: the object store down or frozen is a JSON 503 `StoreUnavailable` with
`Retry-After`, within a bounded time, and the board serves again once the store is back.
Against a SeaweedFS of this test's own, frozen with SIGSTOP and stopped with SIGKILL."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from deltaboard.board.contract.errors import StoreUnavailable
from tests.support.manifests import manifest, publish
from tests.support.servers import BoardServer, S3Server, board_server, seaweedfs

# The board's S3 timeouts here: a frozen store must cost a request about attempts x read
# timeout (plus botocore's backoff), far below the bound the test allows.
TIMEOUT_S = 1.0
ATTEMPTS = 2
BOUND_S = 20.0

Send = Callable[[httpx.Client], httpx.Response]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS for the module: frozen then thawed by the first test, killed by the last."""
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        try:
            yield server
        finally:
            assert server.process is not None
            server.process.send_signal(signal.SIGCONT)  # a stopped process cannot exit


@pytest.fixture
def board_on_s3(tmp_path: Path, store: S3Server) -> Iterator[BoardServer]:
    server = board_server(
        tmp_path / "board",
        **store.settings(store.make_bucket()),
        s3_connect_timeout_s=str(TIMEOUT_S),
        s3_read_timeout_s=str(TIMEOUT_S),
        s3_attempts=str(ATTEMPTS),
    ).start()
    try:
        yield server
    finally:
        server.stop()
    server.check_log()  # no traceback: every failure was an answer


def answer_of(board: BoardServer, send: Send) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    with httpx.Client(
        base_url=board.url, headers={"Authorization": f"Bearer {board.admin_token}"}, timeout=60
    ) as http:
        response = send(http)
    return response, time.monotonic() - started


def assert_unavailable(board: BoardServer, send: Send) -> None:
    response, took = answer_of(board, send)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "StoreUnavailable"
    assert int(response.headers["retry-after"]) > 0
    assert took < BOUND_S, f"{took:.1f}s to answer"


def requests_that_need_the_store(
    board: BoardServer, epoch: int
) -> list[Callable[[httpx.Client], httpx.Response]]:
    late = manifest("r", 1, epoch, {"w": b"one"}).model_dump_json()
    return [
        lambda h: h.post(
            "/v1/runs/r/commit",
            content=f'{{"manifest": {late}}}',
            headers={"Content-Type": "application/json"},
        ),
        lambda h: h.put("/v1/runs/r/assets/config.json", content=b"{}"),
        lambda h: h.post("/v1/runs/r/blobs/" + "a" * 64 + "/upload", params={"size": 3}),
        lambda h: h.post("/v1/runs/r/lease", json={"holder": "other", "steal": True}),
        lambda h: h.get("/v1/runs/r/manifests/0"),
    ]


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_a_store_out_of_reach_is_a_bounded_503(board_on_s3, store, fault):
    c = board_on_s3.client()
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    publish(c, "r", 0, epoch, {"w": b"zero"})
    c.upload_blob("r", b"one")
    assert store.process is not None
    os.kill(store.process.pid, signal.SIGSTOP if fault == "frozen" else signal.SIGKILL)
    for send in requests_that_need_the_store(board_on_s3, epoch):
        assert_unavailable(board_on_s3, send)
    # What the index holds is still served.
    response, _ = answer_of(board_on_s3, lambda h: h.get("/v1/runs/r/head"))
    assert response.status_code == 200 and response.json()["version"] == 0
    with pytest.raises(StoreUnavailable):  # the client's own retries end in the typed error
        board_on_s3.client(retries=1, backoff_s=0.01).commit("r", manifest("r", 1, epoch, {"w": b"one"}))
    if fault == "frozen":
        os.kill(store.process.pid, signal.SIGCONT)
        assert c.commit("r", manifest("r", 1, epoch, {"w": b"one"})).version == 1
