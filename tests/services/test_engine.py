"""The reference engine, served for real on a loopback port."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaboard.services.engine.app import EngineState, create_app
from deltaboard.services.sidecar.background import BackgroundServer
from tests.services.fakes.direct import direct_logprobs
from tests.services.fakes.polling import wait_until
from tests.services.fakes.tiny_model import save_tiny_model

PROMPT = [5, 17, 42, 7]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_tiny_model(root / "a", seed=0), save_tiny_model(root / "b", seed=1)


@pytest.fixture
def engine(models):
    app = create_app(EngineState("tiny"))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, models


def load(client: httpx.Client, directory: Path, version: int | None) -> httpx.Response:
    response = client.post("/reload", json={"model": str(directory), "weight_version": version})
    assert response.status_code == 200, response.text
    return response


def load_direct(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype="auto", attn_implementation="eager")


def test_unloaded_engine_answers_503_then_serves_after_reload(engine):
    client, (a, _) = engine
    refused = client.post("/v1/completions", json={"prompt": PROMPT})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "ModelNotLoaded"
    load(client, a, 3)
    assert client.get("/health").json()["weight_version"] == 3
    assert client.get("/v1/models").json()["data"][0]["weight_version"] == 3


def test_every_response_says_what_the_engine_holds_and_every_load_counts(engine):
    client, (a, b) = engine
    empty = client.get("/health")
    assert empty.json()["status"] == "empty" and empty.json()["loads"] == 0
    assert empty.headers["x-engine-load-count"] == "0" and "x-engine-weight-version" not in empty.headers
    assert load(client, a, 3).json()["loads"] == 1
    request = {"prompt": PROMPT, "max_tokens": 2}
    answer = client.post("/v1/completions", json=request)
    assert answer.headers["x-engine-weight-version"] == "3" and answer.headers["x-engine-load-count"] == "1"
    assert load(client, b, 3).json() == {"weight_version": 3, "loads": 2, "model": str(b)}  # same label
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as streamed:
        assert streamed.headers["x-engine-load-count"] == "2"
    assert client.get("/health").json()["loads"] == 2


def test_logprobs_are_exactly_those_of_a_direct_forward_pass(engine):
    client, (a, _) = engine
    load(client, a, 1)
    body = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    ).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 6
    expected = direct_logprobs(load_direct(a), PROMPT, choice["token_ids"])
    assert choice["logprobs"]["token_logprobs"] == expected  # bit-exact, not approximately
    assert body["weight_version"] == {"start": 1, "end": 1, "spans": [[0, 1]]}
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}


def test_stream_carries_the_same_tokens_and_logprobs(engine):
    client, (a, _) = engine
    load(client, a, 1)
    request = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 0}
    whole = client.post("/v1/completions", json=request).json()["choices"][0]
    events = []
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["token_ids"][0] for c in chunks] == whole["token_ids"]
    streamed = [c["choices"][0]["logprobs"]["token_logprobs"][0] for c in chunks]
    assert streamed == whole["logprobs"]["token_logprobs"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["weight_version"] == {"start": 1, "end": 1, "spans": [[0, 1]]}


def test_chat_and_text_prompts(engine):
    client, (a, _) = engine
    load(client, a, 0)
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()
    choice = chat["choices"][0]
    assert chat["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == 3
    assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])
    text = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).json()
    assert text["choices"][0]["prompt_token_ids"] == list(b"hello")


def test_seeded_sampling_is_reproducible(engine):
    client, (a, _) = engine
    load(client, a, 0)
    request = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 1234}
    first = client.post("/v1/completions", json=request).json()["choices"][0]["token_ids"]
    second = client.post("/v1/completions", json=request).json()["choices"][0]["token_ids"]
    assert first == second


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": []},
        {"prompt": [1, 99999]},
        {"prompt": [1] * 8193},
        {"prompt": [1], "n": 2},
        {"prompt": [1], "max_tokens": 0},
        {"prompt": [1], "temperature": -1},
        {"messages": []},
    ],
)
def test_bad_requests_are_400(engine, body):
    client, (a, _) = engine
    load(client, a, 0)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"]


def test_malformed_json_and_bad_reload_are_400(engine, tmp_path):
    client, (a, _) = engine
    load(client, a, 0)
    assert (
        client.post(
            "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
        ).status_code
        == 400
    )
    assert client.post("/reload", json={"model": str(tmp_path)}).status_code == 400
    assert client.post("/reload", json={"weight_version": -2}).status_code == 400


def test_reload_while_paused_serves_the_new_version_from_the_first_token(engine):
    client, (a, b) = engine
    load(client, a, 1)
    client.post("/pause")
    result = {}
    request = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 0}
    worker = threading.Thread(
        target=lambda: result.update(client.post("/v1/completions", json=request).json())
    )
    worker.start()
    load(client, b, 2)
    client.post("/resume")
    worker.join()
    assert result["weight_version"] == {"start": 2, "end": 2, "spans": [[0, 2]]}
    choice = result["choices"][0]
    assert choice["logprobs"]["token_logprobs"] == direct_logprobs(
        load_direct(b), PROMPT, choice["token_ids"]
    )


def test_client_disconnect_stops_generation(engine):
    client, (a, _) = engine
    load(client, a, 0)
    client.post("/pause")  # hold generation so the request is surely in flight when we leave
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 500, "stream": True}):
        pass  # leave without reading: the connection closes
    client.post("/resume")
    wait_until(lambda: client.get("/health").json()["generating"] == 0, "generation never stopped")
    health = client.get("/health").json()
    assert health["aborted"] == 1 and health["tokens"] < 50  # stopped, not run to 500 tokens
