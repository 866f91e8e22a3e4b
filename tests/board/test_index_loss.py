"""A board on a real Valkey index loses that index (FLUSHALL, a restart without persistence)
while a publisher runs: every run comes back from the store within 5 s without a restart,
routes that miss a run heal it at once, and the publisher keeps publishing, nothing lost."""

from __future__ import annotations

import inspect
import itertools
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from deltaboard.board.server.api.app import create_app
from deltaboard.board.server.index import Index
from deltaboard.board.server.ledger import Ledger
from deltaboard.board.server.settings import Settings
from deltaboard.board.server.storage.local import LocalStore
from deltaboard.publisher.publisher import Publisher
from tests.clients.support import states, view_of
from tests.publisher.pub_support import assert_same_view, materialize
from tests.support.servers import BoardServer, ValkeyServer, board_server

SIZES = {"a": (64, 32), "b": (128,)}
BACK_WITHIN_S = 5.0


@pytest.fixture
def valkey_server(tmp_path: Path) -> Iterator[ValkeyServer]:
    server = ValkeyServer(tmp_path / "valkey").start()
    try:
        yield server
    finally:
        server.stop()


def redis_board(tmp_path: Path, valkey: ValkeyServer, **settings: str) -> BoardServer:
    namespace = f"t{secrets.token_hex(4)}"
    return board_server(tmp_path / "board", redis=valkey.url, redis_namespace=namespace, **settings).start()


def lease_expiry(board: BoardServer, run: str) -> float:
    """The lease's expiry in the store (the truth the board's lease logic reads)."""
    found = Ledger(LocalStore(board.data_dir / "store")).lease(run)
    assert found is not None
    return found[0].expires_at


def wait_for(check, what: str, within_s: float) -> float:
    """Seconds until `check()` holds; fails past `within_s`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within_s, f"{what} not within {within_s}s"
        time.sleep(0.05)
    return time.monotonic() - started


def listed(board: BoardServer, heads: dict[str, int | None]) -> bool:
    """Whether `GET /v1/runs` lists exactly these runs at these heads."""
    runs = board.client(board.read_token).list_runs()
    return {r.name: r.head for r in runs} == heads


def test_routes_heal_the_runs_a_flushed_index_lost(tmp_path, valkey_server):
    board = redis_board(tmp_path, valkey_server, index_check_s="3600")  # no rebuild: healing only
    try:
        writer = board.client(board.publish_token)
        views = []
        with Publisher(writer, "r", assets={}) as pub:
            for state in states(SIZES, 3):
                views.append(view_of(state))
                pub.publish(state).result()
            valkey_server.flushall()
            reader = board.client(board.read_token)
            assert reader.head("r").version == 2
            assert [s.version for s in reader.plan("r", from_version=0).steps] == [1, 2]
            assert_same_view(materialize(reader, "r", 2), views[2])
            assert listed(board, {"r": 2})
            state = next(iter(states(SIZES, 4, seed=1)))
            assert pub.publish(state).result().version == 3
        assert_same_view(materialize(reader, "r", 3), view_of(state))
    finally:
        board.stop()
    board.check_log()


def test_flushed_index_is_rebuilt_while_serving_and_the_publisher_rides_through(tmp_path, valkey_server):
    board = redis_board(tmp_path, valkey_server)
    try:
        writer = board.client(board.publish_token)
        writer.create_run("idle")  # nobody asks for it: only the rebuild brings it back
        views = []
        trajectory = states(SIZES, 6)
        with Publisher(writer, "r", lease_ttl_s=3.0, assets={}) as pub:
            for state in trajectory:
                views.append(view_of(state))
                pub.publish(state).result()
                if len(views) == 3:
                    break
            expiry = lease_expiry(board, "r")
            valkey_server.flushall()
            took = wait_for(lambda: listed(board, {"r": 2, "idle": None}), "every run back", BACK_WITHIN_S)
            print(f"runs back {took:.2f}s after FLUSHALL")
            # The keeper renews against the store's lease record: not fenced by the lost index.
            wait_for(lambda: lease_expiry(board, "r") > expiry, "a lease renewal", 10.0)
            for state in trajectory:
                views.append(view_of(state))
                assert pub.publish(state).result().version == len(views) - 1
        reader = board.client(board.read_token)
        assert reader.head("r").version == 5
        for version in (2, 5):
            assert_same_view(materialize(reader, "r", version), views[version])
    finally:
        board.stop()
    board.check_log()


def test_a_restarted_valkey_is_answered_503_then_rebuilt(tmp_path, valkey_server):
    board = redis_board(tmp_path, valkey_server)
    try:
        writer = board.client(board.publish_token)
        views = []
        trajectory = states(SIZES, 4)
        with Publisher(writer, "r", assets={}) as pub:
            for state in trajectory:
                views.append(view_of(state))
                pub.publish(state).result()
                if len(views) == 2:
                    break
            valkey_server.stop()
            answer = httpx.get(
                f"{board.url}/v1/runs/r/head", headers={"Authorization": f"Bearer {board.read_token}"}
            )
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "IndexUnavailable"
            valkey_server.start()  # same port, empty
            took = wait_for(lambda: listed(board, {"r": 1}), "the run back", BACK_WITHIN_S)
            print(f"run back {took:.2f}s after the restart")
            for state in trajectory:
                views.append(view_of(state))
                assert pub.publish(state).result().version == len(views) - 1
        reader = board.client(board.read_token)
        for version in range(4):
            assert_same_view(materialize(reader, "r", version), views[version])
    finally:
        board.stop()


class Tearing:
    """The board's real Redis index, emptied (FLUSHALL: what a restart without persistence
    leaves) just before its n-th call from `arm(n)` on: a restart that lands between two of
    the board's calls to the index."""

    def __init__(self, index: Index, valkey: ValkeyServer) -> None:
        self._index = index
        self._valkey = valkey
        self._left: int | None = None
        self.torn = False

    def arm(self, n: int) -> None:
        self._left, self.torn = n, False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._index, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self._left is not None:
                self._left -= 1
                if self._left == 0:
                    self._valkey.flushall()
                    self._left, self.torn = None, True
            return await attr(*args, **kwargs)

        return call


def _service_over(board: BoardServer, valkey: ValkeyServer) -> Any:
    """An in-process app over `board`'s data and `valkey` (no periodic check: what the
    loads do on their own), for a test that steps inside its service."""
    settings = Settings(
        data_dir=board.data_dir,
        auth_config=board.data_dir / "auth.json",
        redis=valkey.url,
        index_check_s=3600,
        fsync=False,
    )
    return create_app(settings)


def _published(tmp_path: Path, valkey: ValkeyServer) -> BoardServer:
    board = redis_board(tmp_path, valkey)
    try:
        with Publisher(board.client(board.publish_token), "r", assets={}) as pub:
            for state in states(SIZES, 3):
                pub.publish(state).result()
    finally:
        board.stop()
    return board


def test_an_index_lost_between_any_two_of_its_calls_never_answers_404_for_a_committed_version(
    tmp_path, valkey_server
):
    """Before: a restart between the writes of a run's load left the run and its head in the
    index without the versions, and every plan answered 404 NoChain until the next rebuild."""
    board = _published(tmp_path, valkey_server)
    app = _service_over(board, valkey_server)
    service = app.state.board.service
    tearing = Tearing(service.index, valkey_server)
    service.index = tearing
    with TestClient(app) as http:
        http.headers["Authorization"] = f"Bearer {board.admin_token}"
        for n in itertools.count(1):
            tearing.arm(n)
            created = http.post("/v1/runs", json={"name": "r"})  # a publisher (re)opening the run
            assert created.status_code == 200, (n, created.text)
            for _ in range(2):  # while the index is torn, then once it is not
                answer = http.get("/v1/runs/r/plan", params={"to": 2})
                assert answer.status_code == 200, (n, answer.text)
                assert [step["version"] for step in answer.json()["steps"]] == [0, 1, 2]
            if not tearing.torn:
                break
    assert n > 4  # the tear reached past the run's load and the plan's reads


def test_an_index_that_kept_the_run_but_lost_versions_heals_instead_of_answering_no_chain(
    tmp_path, valkey_server
):
    """Chaos seed 410188417: after a Redis restart the index held the run, its head and the
    newest versions but not the older ones, and every plan to head answered 404 NoChain
    (the index's own answer, though the store holds the whole chain)."""
    import redis

    namespace = f"t{secrets.token_hex(4)}"
    board = board_server(
        tmp_path / "board", redis=valkey_server.url, redis_namespace=namespace, index_check_s="3600"
    ).start()
    try:
        with Publisher(board.client(board.publish_token), "r", assets={}) as pub:
            for state in states(SIZES, 3):
                pub.publish(state).result()
        with redis.Redis.from_url(valkey_server.url) as raw:
            assert raw.hdel(f"{namespace}:versions:r", "0", "1") == 2
        plan = board.client(board.read_token).plan("r", None, 2)
        assert [step.version for step in plan.steps] == [0, 1, 2]
    finally:
        board.stop()


def test_a_rebuild_that_read_the_store_before_the_index_was_lost_writes_nothing(tmp_path, valkey_server):
    """Chaos seed 1030077618: a rebuild read the head from the store (836); commits took
    the index's head on (843, served); the index was flushed, and the rebuild then wrote 836
    into the emptied index: the head went back. A load under a generation the index no
    longer has now writes nothing, and the next check rebuilds from the store."""
    import redis

    board = _published(tmp_path, valkey_server)
    app = _service_over(board, valkey_server)
    service = app.state.board.service
    read_versions = service.ledger.committed_versions
    flushed: list[bool] = []

    def flushing(*args: Any) -> Any:
        if not flushed:  # between the store's head and the index's write: the index is lost
            valkey_server.flushall()
            flushed.append(True)
        return read_versions(*args)

    with TestClient(app) as http, redis.Redis.from_url(valkey_server.url) as raw:
        portal = http.portal
        assert portal is not None
        service.ledger.committed_versions = flushing
        portal.call(service.rebuild)
        assert flushed and raw.hget("deltaboard:runs", "r") is None and not raw.exists("deltaboard:head:r")
        service.ledger.committed_versions = read_versions
        assert portal.call(service.check_index) is True  # another generation: rebuilt
        assert portal.call(service.head, "r").version == 2


def test_a_heal_answers_the_head_a_commit_put_in_the_index_meanwhile(tmp_path, valkey_server):
    """A route that misses a run reads it back from the store; a commit that lands in the
    index during that read is the head it answers, not the older one the store gave first."""
    import redis

    board = _published(tmp_path, valkey_server)
    app = _service_over(board, valkey_server)
    service = app.state.board.service
    read_versions = service.ledger.committed_versions
    newer: list[dict[str, Any]] = []

    with TestClient(app) as http, redis.Redis.from_url(valkey_server.url) as raw:
        stored = json.loads(raw.hget("deltaboard:head:r", "json"))

        def committing(*args: Any) -> Any:
            if not newer:  # as a commit's `advance_head` would, while the heal reads the store
                head = {**stored, "version": 9}
                raw.hset(
                    "deltaboard:head:r",
                    mapping={"json": json.dumps(head), "version": "9", "epoch": str(head["epoch"])},
                )
                newer.append(head)
            return read_versions(*args)

        raw.delete("deltaboard:head:r")  # the head lost, the run and the generation kept
        service.ledger.committed_versions = committing
        http.headers["Authorization"] = f"Bearer {board.read_token}"
        answer = http.get("/v1/runs/r/head")
        assert answer.status_code == 200, answer.text
        assert newer and answer.json()["version"] == 9
