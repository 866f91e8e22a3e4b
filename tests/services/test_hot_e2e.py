"""End to end on the hot path: versions go into the reference engine's weights in place.

Real board (subprocess), real publisher training a tiny model, a real sidecar (follower
inside) with `hot=True`, a real reference engine with `HotWeights`. Every version after
the keyframe must be swapped in place (no reload: the engine's load counter moves by one
per version, the model object stays the same), a request pinned to version N must get
exactly the logprobs of the trainer's view N, and the disk copy must follow.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower import Follower
from deltaboard.publisher.publisher import Publisher
from deltaboard.publisher.view import rollout_view
from deltaboard.services.engine.app import EngineState, create_app
from deltaboard.services.engine.hot import HotWeights
from deltaboard.services.sidecar.background import BackgroundServer
from deltaboard.services.sidecar.node import Sidecar, SidecarConfig
from deltaboard.services.trajectory import build_model, train
from tests.services.fakes.direct import direct_logprobs
from tests.services.test_e2e import PROMPT, pinned, run_view

RUN = "hot-e2e"
STEPS = 2


def hot_sidecar(board: Any, engine_url: str, directory: Any, mode: Any = "quiesce") -> Sidecar:
    return Sidecar(
        SidecarConfig(
            board_url=board.url,
            run=RUN,
            directory=directory,
            engine_url=engine_url,
            mode=mode,
            token=board.read_token,
            node_id="hot-node",
            poll_s=1.0,
            hot=True,
        )
    )


@pytest.mark.parametrize("mode", ["quiesce", "in_place"])
def test_versions_go_into_the_engine_in_place(board, tmp_path, mode):
    model = build_model("tiny", seed=1)
    config: Any = model.config
    views: dict[int, dict[str, Any]] = {}
    answers: dict[int, httpx.Response] = {}
    requests: list[threading.Thread] = []
    state = EngineState("hot")
    state.hot = HotWeights(state.slot)
    with BackgroundServer(create_app(state)) as engine:
        sidecar = hot_sidecar(board, engine.url, tmp_path / "node", mode)
        with BackgroundServer(sidecar.app) as node:
            assets = {"config.json": config.to_json_string().encode()}
            with Publisher(board.url, RUN, token=board.publish_token, assets=assets) as publisher:

                def publish(step: int) -> None:
                    version = publisher.next_version
                    requests.append(threading.Thread(target=pinned, args=(node.url, version, answers)))
                    requests[-1].start()
                    views[version] = {
                        k: v.clone() for k, v in rollout_view(model.state_dict(), ViewSpec()).items()
                    }
                    assert publisher.publish(model, step=step).result().version == version

                for step in train(model, steps=STEPS, lr=1e-3, regime="fp32-master"):
                    publish(step)
                    requests[-1].join()  # one version at a time: each is swapped in before the next
            for thread in requests:
                thread.join()
            swaps = sidecar.status()["swaps"]
            engine_model = state.slot.current
    assert sorted(answers) == sorted(views) == list(range(STEPS + 1))
    for version, response in sorted(answers.items()):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        expected = direct_logprobs(run_view(config, views[version]), PROMPT, choice["token_ids"])
        assert choice["logprobs"]["token_logprobs"] == expected  # exactly, bit for bit
    # version 0 is a keyframe: loaded; every later one went in place, and only in place
    assert [s["path"] for s in swaps] == ["reload"] + ["hot"] * STEPS
    assert all(s["pause_ms"] is not None and s["pause_ms"] >= 0 for s in swaps[1:])
    assert engine_model is not None and engine_model.version == STEPS
    _, loads = state.slot.stamp()
    assert loads == 1 + STEPS  # one load, then one install per patched version: no reload
    with (  # the disk copy followed
        BoardClient(board.url, board.read_token) as client,
        Follower(client, RUN, tmp_path / "node", node_id="check") as disk,
    ):
        assert disk.version == STEPS


def test_a_version_the_engine_cannot_take_in_place_is_reloaded(board, tmp_path):
    """An engine without --hot refuses the patch: the sidecar loads the version from disk."""
    model = build_model("tiny", seed=2)
    config: Any = model.config
    answers: dict[int, httpx.Response] = {}
    with BackgroundServer(create_app(EngineState("cold"))) as engine:
        sidecar = hot_sidecar(board, engine.url, tmp_path / "node")
        with BackgroundServer(sidecar.app) as node:
            assets = {"config.json": config.to_json_string().encode()}
            with Publisher(board.url, RUN, token=board.publish_token, assets=assets) as publisher:
                for step in train(model, steps=1, lr=1e-3, regime="fp32-master"):
                    version = publisher.publish(model, step=step).result().version
                    pinned(node.url, version, answers)  # served before the next is published
            swaps = sidecar.status()["swaps"]
    assert sorted(answers) == [0, 1] and all(r.status_code == 200 for r in answers.values())
    # the keyframe is loaded; the delta the engine refused in place is loaded from disk
    assert [(s["version"], s["path"]) for s in swaps] == [(0, "reload"), (1, "reload")]
