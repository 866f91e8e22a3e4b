"""A whole sidecar (real follower, real board, real engine): start-up, a failing engine
reload and its recovery, the fleet heartbeat, max_lag, and a restart on a held directory."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaboard.clients.engines import CommitMode, EngineAdapter, EngineAdapterError
from deltaboard.clients.engines.reference import ReferenceAdapter
from deltaboard.publisher.publisher import Publisher
from deltaboard.services.engine.app import EngineState, create_app
from deltaboard.services.sidecar.background import BackgroundServer
from deltaboard.services.sidecar.node import Sidecar, SidecarConfig
from deltaboard.services.trajectory import build_model, train
from tests.services.fakes.polling import wait_until

RUN = "node"


class FlakyAdapter(ReferenceAdapter):
    """The reference adapter with an injected fault: reloads fail until `healed` is set."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.healed = threading.Event()

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> None:
        if not self.healed.is_set():
            raise EngineAdapterError("injected: the engine could not load the weights")
        super().reload(model_dir, version, mode)


def complete(url: str, **weight_version: float) -> httpx.Response:
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "weight_version": weight_version}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.fixture
def published(board):
    """A run with versions 0..2 and a way to publish more."""
    model = build_model("tiny", seed=1)
    steps = train(model, steps=4, lr=1e-4, regime="fp32-master")
    config: Any = model.config
    assets = {"config.json": config.to_json_string().encode()}
    with Publisher(board.url, RUN, token=board.publish_token, assets=assets) as publisher:
        next(steps)
        publisher.publish(model).result()
        yield lambda: (next(steps), publisher.publish(model).result().version)[1]


def sidecar_for(
    board: Any, engine_url: str, directory: Path, adapter: EngineAdapter | None = None
) -> Sidecar:
    config = SidecarConfig(
        board.url, RUN, directory, engine_url, token=board.read_token, node_id="n1", poll_s=1.0
    )
    return Sidecar(config, adapter)


def test_sidecar_recovers_from_a_failed_reload_and_keeps_up(board, published, tmp_path):
    with BackgroundServer(create_app(EngineState("t"))) as engine:
        adapter = FlakyAdapter(engine.url)
        sidecar = sidecar_for(board, engine.url, tmp_path / "dir", adapter)
        with BackgroundServer(sidecar.app) as node:
            wait_until(lambda: sidecar.sync.last_error is not None, "the injected fault never happened")
            assert httpx.get(f"{node.url}/healthz").status_code == 503
            refused = complete(node.url, wait=0)
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"]["code"] == "EngineUnavailable"
            adapter.healed.set()
            served = complete(node.url, exact=0, wait=60)
            assert served.status_code == 200 and served.json()["weight_version"] == {"start": 0, "end": 0}
            assert httpx.get(f"{node.url}/healthz").json()["healthy"] is True
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
            latest = complete(node.url, max_lag=0, wait=60)
            assert latest.json()["weight_version"] == {"start": head, "end": head}
            assert httpx.get(f"{node.url}/healthz").json()["lag"] == 0


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
            assert complete(node.url, exact=0, wait=60).json()["weight_version"] == {"start": 0, "end": 0}


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
            assert httpx.get(f"{engine.url}/health").json()["reloads"] == 1
