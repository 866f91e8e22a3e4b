"""End to end: a request pinned to version N returns exactly the token logprobs that the
trainer's bf16 view of version N gives when run directly.

Real board (subprocess), real publisher, real follower inside a real sidecar, real
reference engine; the trainer keeps each version's rollout view and the test runs those
views itself, with no engine code involved.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.publisher.publisher import Publisher
from deltaboard.publisher.view import rollout_view
from deltaboard.services.engine.app import EngineState, create_app
from deltaboard.services.sidecar.background import BackgroundServer
from deltaboard.services.sidecar.node import Sidecar, SidecarConfig
from deltaboard.services.trajectory import build_model, train
from tests.services.fakes.direct import direct_logprobs

RUN = "e2e"
PROMPT = [3, 14, 15, 92, 65]
STEPS = 3


def run_view(config: Any, view: dict[str, Any]) -> Any:
    """A model holding exactly `view` (bf16 tensors), computing in bf16 with eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=torch.bfloat16, attn_implementation="eager"
    )
    model.load_state_dict(view)
    return model.eval()


def pinned(url: str, version: int, out: dict[int, httpx.Response]) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 0,
        "weight_version": {"exact": version, "wait": 120},
    }
    out[version] = httpx.post(f"{url}/v1/completions", json=body, timeout=180)


@pytest.mark.parametrize("mode", ["quiesce", "in_place"])
def test_pinned_request_returns_the_logprobs_of_that_version(board, tmp_path, mode):
    model = build_model("tiny", seed=0)
    config: Any = model.config
    views: dict[int, dict[str, Any]] = {}
    answers: dict[int, httpx.Response] = {}
    requests: list[threading.Thread] = []
    with BackgroundServer(create_app(EngineState("e2e"))) as engine:
        sidecar = Sidecar(
            SidecarConfig(
                board_url=board.url,
                run=RUN,
                directory=tmp_path / "node",
                engine_url=engine.url,
                mode=mode,
                token=board.read_token,
                node_id="e2e-node",
                poll_s=1.0,
            )
        )
        with BackgroundServer(sidecar.app) as node:
            assets = {"config.json": config.to_json_string().encode()}
            with Publisher(board.url, RUN, token=board.publish_token, assets=assets) as publisher:

                def publish(step: int) -> None:
                    version = publisher.next_version
                    # pinned before it exists: the node stops at this version for the request
                    requests.append(threading.Thread(target=pinned, args=(node.url, version, answers)))
                    requests[-1].start()
                    views[version] = {
                        k: v.clone() for k, v in rollout_view(model.state_dict(), ViewSpec()).items()
                    }
                    assert publisher.publish(model, step=step).result().version == version

                for step in train(model, steps=STEPS, lr=1e-3, regime="fp32-master"):
                    publish(step)
            for thread in requests:
                thread.join()
    assert sorted(answers) == sorted(views) == list(range(STEPS + 1))
    for version, response in sorted(answers.items()):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["weight_version"] == {"start": version, "end": version, "spans": [[0, version]]}
        assert response.headers["x-weight-version-start"] == str(version)
        choice = body["choices"][0]
        expected = direct_logprobs(run_view(config, views[version]), PROMPT, choice["token_ids"])
        assert choice["logprobs"]["token_logprobs"] == expected  # exactly, bit for bit
        if version > 0:  # the check can tell versions apart: the previous view gives other numbers
            other = direct_logprobs(run_view(config, views[version - 1]), PROMPT, choice["token_ids"])
            assert other != expected
