"""A whole sidecar (real follower, real board, real engine): start-up, a failing engine
reload and its recovery, the fleet heartbeat, max_lag, a restart on a held directory,
weights loaded behind its back, a port it cannot take, and what stops it for good."""

from __future__ import annotations

import gc
import multiprocessing
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deltaboard.clients.engines import CommitMode, EngineAdapter, EngineAdapterError, EngineStamp
from deltaboard.clients.engines.reference import ReferenceAdapter
from deltaboard.clients.follower import Follower
from deltaboard.publisher.publisher import Publisher
from deltaboard.services.engine.app import EngineState, create_app
from deltaboard.services.sidecar.background import GC_YOUNG_THRESHOLD, BackgroundServer
from deltaboard.services.sidecar.node import Sidecar, SidecarConfig, SidecarFailed
from deltaboard.services.trajectory import build_model, train
from tests.services.fakes.polling import wait_until
from tests.services.fakes.tiny_model import save_tiny_model

RUN = "node"


class FlakyAdapter(ReferenceAdapter):
    """The reference adapter with an injected fault: reloads fail until `healed` is set."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.healed = threading.Event()

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> EngineStamp:
        if not self.healed.is_set():
            raise EngineAdapterError("injected: the engine could not load the weights")
        return super().reload(model_dir, version, mode)


def complete(url: str, **weight_version: float) -> httpx.Response:
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "weight_version": weight_version}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def tiny_publisher(board: Any) -> tuple[Publisher, Any]:
    """A publisher of the run, and the tiny model it publishes."""
    model = build_model("tiny", seed=1)
    config: Any = model.config
    assets = {"config.json": config.to_json_string().encode()}
    return Publisher(board.url, RUN, token=board.publish_token, assets=assets), model


@pytest.fixture
def published(board):
    """A run with versions 0..2 and a way to publish more."""
    publisher, model = tiny_publisher(board)
    steps = train(model, steps=4, lr=1e-4, regime="fp32-master")
    with publisher:
        next(steps)
        publisher.publish(model).result()
        yield lambda: (next(steps), publisher.publish(model).result().version)[1]


def sidecar_for(
    board: Any, engine_url: str, directory: Path, adapter: EngineAdapter | None = None, **config: Any
) -> Sidecar:
    settings = {"run": RUN, "token": board.read_token, **config}
    return Sidecar(
        SidecarConfig(
            board.url, directory=directory, engine_url=engine_url, node_id="n1", poll_s=1.0, **settings
        ),
        adapter,
    )


def healthz(url: str) -> httpx.Response:
    """The node's /healthz: 503 unless it serves a version and is healthy; its body is the status."""
    return httpx.get(f"{url}/healthz")


def loads(engine_url: str) -> int:
    count: int = httpx.get(f"{engine_url}/health").json()["loads"]
    return count


def test_sidecar_recovers_from_a_failed_reload_and_keeps_up(board, published, tmp_path):
    with BackgroundServer(create_app(EngineState("t"))) as engine:
        adapter = FlakyAdapter(engine.url)
        sidecar = sidecar_for(board, engine.url, tmp_path / "dir", adapter)
        with BackgroundServer(sidecar.app) as node:
            # The node's own word, not the loop's `last_error`: that is set as the reload
            # fails, a moment before the swap ends and the gate says unhealthy (until then a
            # request is refused as during any swap, 409 WeightVersionNotReady).
            wait_until(lambda: not healthz(node.url).json()["healthy"], "the injected fault never showed")
            unhealthy = healthz(node.url)
            assert unhealthy.status_code == 503 and "injected" in unhealthy.json()["problem"]
            refused = complete(node.url, wait=0)
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"]["code"] == "EngineUnavailable"
            adapter.healed.set()
            served = complete(node.url, exact=0, wait=60)
            assert served.status_code == 200
            assert served.json()["weight_version"] == {"start": 0, "end": 0, "spans": [[0, 0]]}
            assert healthz(node.url).json()["healthy"] is True
            metrics = httpx.get(f"{node.url}/metrics").text
            failures = next(
                line
                for line in metrics.splitlines()
                if line.startswith("deltaboard_sidecar_swap_failures_total")
            )
            assert float(failures.split()[-1]) >= 1
            fleet = board.client(board.read_token).fleet(RUN)
            assert [(n.node_id, n.version) for n in fleet] == [("n1", 0)]

            published()
            head = published()
            # max_lag counts from the head the node has seen: its long-poll of the board may
            # answer after the publisher's commit does, and a request before then is judged
            # against the head before (and served the version before) by design
            wait_until(lambda: healthz(node.url).json()["head"] == head, "the node never saw the head")
            latest = complete(node.url, max_lag=0, wait=60)
            assert latest.json()["weight_version"] == {"start": head, "end": head, "spans": [[0, head]]}
            assert healthz(node.url).json()["lag"] == 0


def test_an_engine_that_restarted_empty_is_reloaded(board, published, tmp_path):
    first = BackgroundServer(create_app(EngineState("t"))).start()
    sidecar = sidecar_for(board, first.url, tmp_path / "dir")
    with BackgroundServer(sidecar.app) as node:
        assert complete(node.url, exact=0, wait=60).status_code == 200
        first.stop()  # the engine dies; a new, empty one takes its port
        with BackgroundServer(create_app(EngineState("t")), port=first.port) as second:
            wait_until(
                lambda: httpx.get(f"{second.url}/health").json()["weight_version"] == 0, "never reloaded"
            )
            answer = complete(node.url, exact=0, wait=60)
            assert answer.json()["weight_version"] == {"start": 0, "end": 0, "spans": [[0, 0]]}


def test_restarted_sidecar_serves_the_version_its_directory_holds(board, published, tmp_path):
    directory = tmp_path / "dir"
    with BackgroundServer(create_app(EngineState("t"))) as engine:
        sidecar = sidecar_for(board, engine.url, directory)
        with BackgroundServer(sidecar.app) as node:
            assert complete(node.url, exact=0, wait=60).status_code == 200
    # a fresh, empty engine and a new sidecar on the same directory: no download, a reload
    with BackgroundServer(create_app(EngineState("t"))) as engine:
        sidecar = sidecar_for(board, engine.url, directory)
        with BackgroundServer(sidecar.app) as node:
            served = complete(node.url, exact=0, wait=60)
            assert served.status_code == 200 and served.json()["weight_version"]["end"] == 0
            assert loads(engine.url) == 1


def test_weights_loaded_behind_its_back_are_never_stamped_and_are_replaced(board, published, tmp_path):
    other = save_tiny_model(tmp_path / "other", seed=5)
    with BackgroundServer(create_app(EngineState("t"))) as engine:
        sidecar = sidecar_for(board, engine.url, tmp_path / "dir")
        with BackgroundServer(sidecar.app) as node:
            good = complete(node.url, exact=0, wait=60)
            assert good.status_code == 200 and loads(engine.url) == 1
            httpx.post(f"{engine.url}/reload", json={"model": str(other), "weight_version": 0})
            answer = complete(node.url, exact=0, wait=60)
            # refused, or (if the sidecar's own check came first) served with its own weights again
            assert answer.status_code in (200, 503)
            if answer.status_code == 503:
                assert answer.json()["error"]["code"] == "EngineChanged"
                answer = complete(node.url, exact=0, wait=60)
            assert answer.status_code == 200 and answer.json()["choices"] == good.json()["choices"]
            assert loads(engine.url) == 3  # the foreign load, then the sidecar's own again


def test_a_sidecar_that_cannot_listen_never_touches_the_engine(board, published, tmp_path):
    with BackgroundServer(create_app(EngineState("t"))) as engine:
        first = sidecar_for(board, engine.url, tmp_path / "a")
        with BackgroundServer(first.app) as node:
            assert complete(node.url, exact=0, wait=60).status_code == 200
            # another directory that holds a version, the same engine, the first one's port
            with Follower(board.client(board.read_token), RUN, tmp_path / "b", node_id="b") as follower:
                follower.sync(0)
            second = sidecar_for(board, engine.url, tmp_path / "b")
            with pytest.raises(OSError, match="cannot listen"):
                second.serve(node.host, node.port)
            assert second.follower is None  # its version loop never started
            assert loads(engine.url) == 1


def test_a_refused_token_or_a_missing_run_stops_the_sidecar_with_its_reason(board, published, tmp_path):
    with BackgroundServer(create_app(EngineState("t"))) as engine:
        refused = sidecar_for(board, engine.url, tmp_path / "a", token="not-a-token")
        failed: list[BaseException] = []
        collector = (gc.get_freeze_count(), gc.get_threshold())  # this process's

        def serve() -> None:
            try:
                refused.serve("127.0.0.1", 0)
            except SidecarFailed as exc:
                failed.append(exc)

        thread = threading.Thread(target=serve)
        thread.start()
        thread.join(60)
        assert not thread.is_alive() and "Unauthorized" in str(failed[0])  # serve() returned at once
        # served from a thread, not its own process: the collector is left as it was
        assert (gc.get_freeze_count(), gc.get_threshold()) == collector

        missing = sidecar_for(board, engine.url, tmp_path / "b", run="missing", run_wait_s=0)
        with BackgroundServer(missing.app) as node:
            # the node's word again: the loop's `fatal` is set a moment before the gate stops
            wait_until(lambda: healthz(node.url).json()["problem"], "the sidecar kept waiting for the run")
            health = healthz(node.url)
            assert health.status_code == 503 and "UnknownRun" in health.json()["problem"]
            answer = complete(node.url, wait=0)
            assert answer.status_code == 503 and "UnknownRun" in answer.json()["error"]["message"]
        assert loads(engine.url) == 0


def test_a_sidecar_in_a_process_of_its_own_serves_with_its_startup_out_of_the_collector(board, tmp_path):
    """`deltaboard sidecar` (`Sidecar.serve` in a process's main thread) settles the garbage
    collector once started (`background.settle_gc`); served from a thread of another
    process it leaves that process's collector alone (the refused token's test above)."""
    sidecar = sidecar_for(board, "http://127.0.0.1:9", tmp_path / "dir", run="not-yet", run_wait_s=600)

    async def collector(_: Request) -> JSONResponse:  # the child's, ahead of the proxy's routes
        return JSONResponse({"frozen": gc.get_freeze_count() > 0, "threshold": gc.get_threshold()[0]})

    sidecar.app.app.router.routes.insert(0, Route("/test/gc", collector))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    child = multiprocessing.get_context("fork").Process(target=sidecar.serve, args=("127.0.0.1", port))
    child.start()
    try:
        url = f"http://127.0.0.1:{port}/test/gc"
        wait_until(lambda: _answers(url), "the sidecar never served", timeout_s=120)
        assert httpx.get(url).json() == {"frozen": True, "threshold": GC_YOUNG_THRESHOLD}
    finally:
        child.terminate()
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join(10)


def test_a_run_that_does_not_exist_yet_is_waited_for(board, tmp_path):
    with BackgroundServer(create_app(EngineState("t"))) as engine:
        sidecar = sidecar_for(board, engine.url, tmp_path / "dir", run_wait_s=120)
        with BackgroundServer(sidecar.app) as node:
            publisher, model = tiny_publisher(board)
            with publisher:
                publisher.publish(model).result()
            assert complete(node.url, exact=0, wait=60).status_code == 200
            assert sidecar.sync.fatal is None


def test_a_sidecar_of_worker_processes_follows_the_run(board, published, tmp_path):
    """`deltaboard sidecar --workers 2`: the owner's version loop swaps every worker."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cli = [sys.executable, "-c", "from deltaboard.services.cli import main; main()", "sidecar"]
    options = [f"--board={board.url}", f"--run={RUN}", f"--dir={tmp_path / 'dir'}", f"--port={port}"]
    env = {"DELTABOARD_TOKEN": board.read_token, "PATH": ""}
    with BackgroundServer(create_app(EngineState("t"))) as engine, (tmp_path / "log").open("wb") as log:
        process = subprocess.Popen(
            [*cli, *options, f"--engine={engine.url}", "--poll=1", "--workers=2"],
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            wait_until(lambda: _answers(f"{url}/healthz"), "the workers never served", timeout_s=120)
            assert complete(url, exact=0, wait=60).json()["weight_version"]["start"] == 0
            head = published()
            latest = complete(url, min=head, wait=60)
            assert latest.json()["weight_version"] == {"start": head, "end": head, "spans": [[0, head]]}
            statuses = [httpx.get(f"{url}/sidecar/status").json() for _ in range(8)]
            assert {s["served"] for s in statuses} == {head}  # every worker it reached
            wait_until(lambda: httpx.get(f"{url}/sidecar/status").json()["swaps"], "no swaps shown")
            # /metrics is the fleet's, whichever worker answers: the owner's loop swapped, and
            # the workers' two answers are counted together
            for _ in range(8):
                samples = dict(line.rsplit(" ", 1) for line in httpx.get(f"{url}/metrics").text.splitlines())
                assert float(samples["deltaboard_sidecar_swaps_total"]) >= 1
                assert float(samples['deltaboard_sidecar_requests_total{outcome="proxied"}']) == 2
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) is not None, (tmp_path / "log").read_text()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
