"""The sidecar proxy with its version gate driven directly (the follower is tested apart):
real engine and real HTTP servers on loopback. `Node.serve` plays the version loop: it
swaps, reloads the engine if asked, and records what the engine then reports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware.gzip import GZipMiddleware

from deltaboard.clients.engines import EngineStamp, make_adapter
from deltaboard.services.engine.app import EngineState, create_app
from deltaboard.services.sidecar.background import BackgroundServer
from deltaboard.services.sidecar.gate import VersionGate
from deltaboard.services.sidecar.metrics import SidecarMetrics
from deltaboard.services.sidecar.proxy import Proxy, ProxySettings, create_proxy_app
from tests.services.fakes.direct import direct_logprobs
from tests.services.fakes.echo import echo_engine
from tests.services.fakes.held_slot import HeldSlot
from tests.services.fakes.polling import wait_until
from tests.services.fakes.tiny_model import save_tiny_model

PROMPT = [3, 1, 4, 1, 5]


class Node:
    """A sidecar app in front of `engine_url`, with the gate in the test's hands."""

    def __init__(
        self,
        engine_url: str,
        mode: str = "quiesce",
        abort_stale: bool = False,
        engine_timeout_s: float = 600.0,
    ) -> None:
        self.gate = VersionGate(mode, drain_timeout_s=30, abort_stale=abort_stale)  # type: ignore[arg-type]

        @asynccontextmanager
        async def bind(app):
            self.gate.bind(asyncio.get_running_loop())
            yield

        status = lambda: {"served": self.gate.served, "healthy": self.gate.healthy}  # noqa: E731
        self.adapter = make_adapter("reference", engine_url)
        settings = ProxySettings(engine_url, default_wait_s=0.0, engine_timeout_s=engine_timeout_s)
        app = create_proxy_app(self.gate, self.adapter, settings, SidecarMetrics(), status, bind)
        self.server = BackgroundServer(app).start()
        self.client = httpx.Client(base_url=self.server.url, timeout=60)

    def serve(
        self, version: int, reload: Callable[[], object] | None = None, stamp: EngineStamp | None = None
    ) -> None:
        self.gate.begin_swap(version)
        if reload is not None:
            reload()
        self.gate.end_swap(version, 0.01, stamp or self.adapter.loaded())

    def close(self) -> None:
        self.client.close()
        self.adapter.close()
        self.server.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "m")


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("other") / "m", seed=1)


@pytest.fixture
def engine(model_dir):
    with BackgroundServer(create_app(EngineState("tiny"))) as server:
        httpx.post(
            f"{server.url}/reload", json={"model": str(model_dir), "weight_version": 1}
        ).raise_for_status()
        yield server.url


@pytest.fixture
def echo():
    with BackgroundServer(echo_engine()) as server:
        yield server.url


@pytest.fixture
def node(engine):
    n = Node(engine)
    n.serve(1)
    yield n
    n.close()


@pytest.fixture
def echo_node(echo):
    n = Node(echo)
    n.serve(4)
    n.gate.publish_head(6)
    yield n
    n.close()


def completion(
    node: Node, weight_version: Any = None, headers: dict[str, str] | None = None, **extra: Any
) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 0, **extra}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return node.client.post("/v1/completions", json=body, headers=headers or {})


def test_satisfied_request_is_proxied_and_stamped(node):
    response = completion(node, {"exact": 1})
    assert response.status_code == 200
    assert (
        response.headers["x-weight-version-start"] == "1" and response.headers["x-weight-version-end"] == "1"
    )
    assert response.json()["weight_version"] == {"start": 1, "end": 1, "spans": [[0, 1]]}
    assert len(response.json()["choices"][0]["token_ids"]) == 3
    # the sidecar's server dates and names its responses: the engine's are not passed on too
    assert len(response.headers.get_list("date")) == 1 and len(response.headers.get_list("server")) == 1


def test_control_routes_never_reach_the_engine(node, engine, model_dir, other_model_dir):
    before = completion(node, {"exact": 1}).json()
    for path, body in (("/reload", {"model": str(other_model_dir), "weight_version": 1}), ("/pause", {})):
        refused = node.client.post(path, json=body)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "NotFound"
    health = httpx.get(f"{engine}/health").json()
    assert health["loads"] == 1 and health["paused"] is False and health["model"] == str(model_dir)
    after = completion(node, {"exact": 1})
    assert after.status_code == 200 and after.json()["choices"] == before["choices"]
    wrong_method = node.client.get("/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["code"] == "MethodNotAllowed"


def test_a_reload_behind_the_sidecars_back_is_never_stamped(node, engine, other_model_dir):
    assert completion(node, {"exact": 1}).status_code == 200
    # someone with the engine's own port loads other weights under the same version number
    httpx.post(f"{engine}/reload", json={"model": str(other_model_dir), "weight_version": 1})
    refused = completion(node, {"exact": 1})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert (
        refused.json()["error"]["code"] == "EngineChanged" and "loads=2" in refused.json()["error"]["message"]
    )
    assert node.client.get("/healthz").status_code == 503  # until the version loop loads version 1 again
    assert node.gate.problem is not None and "changed under the sidecar" in node.gate.problem


def test_a_stream_whose_weights_changed_under_it_ends_with_an_error(node, engine, other_model_dir):
    httpx.post(f"{engine}/pause")
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "weight_version": 1}
    with node.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200  # the engine held what the sidecar loaded when it began
        httpx.post(f"{engine}/reload", json={"model": str(other_model_dir), "weight_version": 1})
        httpx.post(f"{engine}/resume")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "EngineChanged"
    assert all("weight_version" not in json.loads(e) for e in events[:-1])


def test_the_engine_is_asked_its_stamp_once_for_all_who_ask_in_one_turn():
    """Streams that end together (or engines that stamp no response) share one question to
    the engine's stamp path; a request asking after that question went out gets its own."""
    asked: list[bytes] = []

    async def health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # until the sidecar's pool closes its connection, or the test's loop ends
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            while True:
                asked.append(await reader.readuntil(b"\r\n\r\n"))
                body = b'{"weight_version": 3, "loads": 2}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    async def main() -> tuple[list[Any], Any]:
        server = await asyncio.start_server(health, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        adapter = make_adapter("reference", url)
        proxy = Proxy(VersionGate("quiesce"), adapter, ProxySettings(url), SidecarMetrics())
        together = await asyncio.gather(*(proxy.engine_stamp(None) for _ in range(5)))
        later = await proxy.engine_stamp(None)
        await proxy.pool.aclose()
        adapter.close()
        server.close()
        return together, later

    together, later = asyncio.run(main())
    assert together == [EngineStamp("3", loads=2)] * 5 and later == EngineStamp("3", loads=2)
    assert len(asked) == 2 and all(head.startswith(b"GET /health ") for head in asked)


def test_constraint_is_removed_before_forwarding_and_everything_else_passes(echo_node):
    response = echo_node.client.post(
        "/v1/completions?x=1",
        json={"a": 1, "weight_version": {"min": 3}},
        headers={"X-Weight-Version-Max": "9", "X-Custom": "kept"},
    )
    seen = response.json()
    assert seen["body"] == {"a": 1} and seen["query"] == {"x": "1"}
    assert seen["headers"]["x-custom"] == "kept" and "x-weight-version-max" not in seen["headers"]
    assert seen["weight_version"] == {"start": 4, "end": 4, "spans": [[0, 4]]}
    models = echo_node.client.get("/v1/models")
    assert models.text == "plain"  # not JSON: only headers carry the range
    assert models.headers["x-weight-version-start"] == "4"
    failed = echo_node.client.post("/v1/completions?status=422", json={})
    assert failed.status_code == 422
    assert failed.json()["weight_version"] == {"start": 4, "end": 4, "spans": [[0, 4]]}


def test_an_engine_that_compresses_when_asked_is_asked_for_plain_bodies():
    app = echo_engine()
    app.add_middleware(GZipMiddleware, minimum_size=1)
    with BackgroundServer(app) as server:
        node = Node(server.url)
        try:
            node.serve(4)
            response = node.client.post("/v1/completions", json={"a": 1}, headers={"Accept-Encoding": "gzip"})
            assert "accept-encoding" not in response.json()["headers"]  # what reached the engine
            assert response.json()["weight_version"] == {"start": 4, "end": 4, "spans": [[0, 4]]}
        finally:
            node.close()


def test_stream_last_event_carries_the_range(node):
    with node.client.stream(
        "POST",
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "stream": True, "weight_version": 1},
    ) as response:
        assert response.headers["x-weight-version-start"] == "1"
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 5  # the 4 tokens, then the range in an event of its own
    assert chunks[-1] == {"choices": [], "weight_version": {"start": 1, "end": 1, "spans": [[0, 1]]}}
    assert all("weight_version" not in c for c in chunks[:-1])  # the engine's own taken out


@pytest.mark.parametrize("done", [True, False])
def test_stream_restamping_keeps_every_event(echo_node, done):
    body = {"stream": True, "n": 3, "done": done}
    with echo_node.client.stream("POST", "/v1/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line]
    data = [json.loads(line[6:]) for line in events if line.startswith("data: {")]
    assert data == [
        {"i": 0},
        {"i": 1},
        {"i": 2},
        {"choices": [], "weight_version": {"start": 4, "end": 4, "spans": [[0, 4]]}},
    ]
    assert events[0] == ": a comment" and (events[-1] == "data: [DONE]") == done


def test_behind_request_waits_for_catch_up(node, engine, model_dir):
    result: dict[str, httpx.Response] = {}
    waiter = threading.Thread(target=lambda: result.update(r=completion(node, {"exact": 2, "wait": 30})))
    waiter.start()
    while node.client.get("/sidecar/status").json()["pins"] != [[2, 2]]:
        time.sleep(0.01)
    node.serve(2, lambda: httpx.post(f"{engine}/reload", json={"model": str(model_dir), "weight_version": 2}))
    waiter.join()
    assert result["r"].status_code == 200
    assert result["r"].json()["weight_version"] == {"start": 2, "end": 2, "spans": [[0, 2]]}


def test_not_ready_is_409_with_retry_after(node):
    node.gate.publish_head(3)
    response = completion(node, {"min": 5, "wait": 0.2})
    assert response.status_code == 409
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["code"] == "WeightVersionNotReady" and error["retryable"] is True
    assert error["served"] == 1 and error["head"] == 3 and error["required"] == {"min": 5, "max": None}


def test_older_version_is_gone_and_not_retryable(node):
    node.serve(3)
    response = completion(node, headers={"X-Weight-Version-Exact": "2"})
    assert response.status_code == 410 and "retry-after" not in response.headers
    assert response.json()["error"]["code"] == "WeightVersionGone"
    assert response.json()["error"]["retryable"] is False


def test_malformed_constraint_is_400(node):
    assert completion(node, {"exact": -3}).status_code == 400
    assert (
        completion(node, headers={"X-Weight-Version-Min": "soon"}).json()["error"]["code"]
        == "BadWeightVersion"
    )


def test_oversize_body_is_413(echo_node):
    big = b'{"pad": "' + b"x" * (64 * 2**20) + b'"}'
    response = echo_node.client.post(
        "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "BodyTooLarge"
    chunks = (b"x" * 2**20 for _ in range(65))  # no Content-Length: counted while read
    response = echo_node.client.post(
        "/v1/completions", content=chunks, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert echo_node.gate.inflight == 0


def test_engine_down_is_503_with_retry_after():
    with BackgroundServer(echo_engine()) as gone:
        url = gone.url
    n = Node(url)
    try:
        n.serve(1, stamp=EngineStamp(None, loads=1))
        response = completion(n)
        assert response.status_code == 503 and response.headers["retry-after"]
        assert response.json()["error"]["code"] == "EngineUnavailable"
        assert n.gate.inflight == 0
    finally:
        n.close()


def slow_engine(pause_s: float) -> FastAPI:
    """An engine that answers a plain request only after `pause_s`, and streams an event,
    then after `pause_s` the rest."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(request: Request) -> Response:
        if not (await request.json()).get("stream"):
            await asyncio.sleep(pause_s)
            return JSONResponse({"choices": []})

        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"i": 0}\n\n'
            await asyncio.sleep(pause_s)
            yield b'data: {"i": 1}\n\ndata: [DONE]\n\n'

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"weight_version": 1, "loads": 1}

    return app


def test_the_engine_timeout_bounds_an_answer_and_a_streams_head_not_the_stream():
    with BackgroundServer(slow_engine(pause_s=1.0)) as engine:
        n = Node(engine.url, engine_timeout_s=0.3)
        try:
            n.serve(1, stamp=EngineStamp("1", loads=1))
            late = completion(n)
            assert late.status_code == 503 and late.headers["retry-after"]
            error = late.json()["error"]
            assert error["code"] == "EngineUnavailable" and "TimeoutError" in error["message"]
            stream = completion(n, stream=True)
            assert stream.status_code == 200
            events = [e for e in stream.text.split("\n\n") if e]
            assert events[:2] == ['data: {"i": 0}', 'data: {"i": 1}'] and events[-1] == "data: [DONE]"
            assert json.loads(events[-2][6:])["weight_version"] == {"start": 1, "end": 1, "spans": [[0, 1]]}
            assert n.gate.inflight == 0
        finally:
            n.close()


def aborted(engine: str) -> int:
    count: int = httpx.get(f"{engine}/health").json()["aborted"]
    return count


def test_client_disconnect_aborts_the_upstream_request(node, engine):
    httpx.post(f"{engine}/pause")
    with node.client.stream(
        "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "stream": True}
    ):
        wait_until(lambda: node.gate.inflight == 1, "stream never admitted")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{node.server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 400}, timeout=1.0
        )
    httpx.post(f"{engine}/resume")
    wait_until(lambda: aborted(engine) >= 2, "the engine kept generating for a departed client")
    wait_until(lambda: node.gate.inflight == 0, "admissions leaked")


def test_a_client_that_leaves_while_its_request_waits_is_forgotten(node):
    """A request waiting for its version whose client goes away stops waiting: its pin no
    longer holds the node back, and it is counted as aborted."""
    body = json.dumps({"prompt": PROMPT, "weight_version": {"exact": 2, "wait": 300}}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    with socket.create_connection((node.server.host, node.server.port)) as client:
        client.sendall(head.encode() + body)
        wait_until(lambda: node.client.get("/sidecar/status").json()["pins"] == [[2, 2]], "never waited")
    wait_until(
        lambda: node.client.get("/sidecar/status").json()["pins"] == [], "the departed request waits on"
    )
    aborted = 'deltaboard_sidecar_requests_total{outcome="aborted"} 1.0'
    wait_until(lambda: aborted in node.client.get("/metrics").text, "not counted as aborted")


def test_quiesce_swap_drains_in_flight_requests_first(node, engine):
    httpx.post(f"{engine}/pause")
    result: dict[str, httpx.Response] = {}
    request = threading.Thread(target=lambda: result.update(r=completion(node)))
    request.start()
    wait_until(lambda: node.gate.inflight == 1, "request never admitted")
    swap = threading.Thread(target=node.serve, args=(2,))
    swap.start()
    wait_until(lambda: node.gate.swapping, "swap never started")
    assert swap.is_alive() and node.gate.served == 1  # held by the request in flight
    httpx.post(f"{engine}/resume")
    request.join()
    swap.join()
    assert result["r"].json()["weight_version"] == {"start": 1, "end": 1, "spans": [[0, 1]]}
    assert node.gate.served == 2


def test_in_place_swap_reports_the_range_it_spanned(engine, model_dir):
    n = Node(engine, mode="in_place")
    try:
        n.serve(1)
        httpx.post(f"{engine}/pause")
        result: dict[str, httpx.Response] = {}
        request = threading.Thread(target=lambda: result.update(r=completion(n)))
        request.start()
        wait_until(lambda: n.gate.inflight == 1, "request never admitted")
        n.serve(
            2, lambda: httpx.post(f"{engine}/reload", json={"model": str(model_dir), "weight_version": 2})
        )
        httpx.post(f"{engine}/resume")
        request.join()
        # admitted at 1, every token from 2: the engine says so, within the sidecar's range
        assert result["r"].json()["weight_version"] == {"start": 1, "end": 2, "spans": [[0, 2]]}
        assert result["r"].headers["x-weight-version-end"] == "2"
    finally:
        n.close()


def test_in_place_swap_waits_for_requests_pinned_below_the_new_version(engine, model_dir):
    n = Node(engine, mode="in_place")
    try:
        n.serve(1)
        httpx.post(f"{engine}/pause")
        result: dict[str, httpx.Response] = {}
        request = threading.Thread(target=lambda: result.update(r=completion(n, {"exact": 1})))
        request.start()
        wait_until(lambda: n.gate.inflight == 1, "request never admitted")
        swap = threading.Thread(target=n.serve, args=(2,))
        swap.start()
        wait_until(lambda: n.gate.swapping, "swap never started")
        assert swap.is_alive() and n.gate.served == 1  # version 2 would break the pinned request
        httpx.post(f"{engine}/resume")
        request.join()
        swap.join()
        assert result["r"].json()["weight_version"] == {"start": 1, "end": 1, "spans": [[0, 1]]}
        assert n.gate.served == 2
    finally:
        n.close()


@contextmanager
def held_engine(model_dir: Path, after: int) -> Iterator[tuple[str, HeldSlot]]:
    """A reference engine serving `model_dir` as version 1 that holds every request after
    `after` tokens (`HeldSlot`), so that a swap lands exactly there."""
    slot = HeldSlot(after)
    with BackgroundServer(create_app(EngineState("tiny", slot=slot))) as server:
        load = {"model": str(model_dir), "weight_version": 1}
        httpx.post(f"{server.url}/reload", json=load).raise_for_status()
        yield server.url, slot


def load_direct(directory: Path) -> Any:
    """The checkpoint run directly, as the engine computes (stored dtype, eager attention)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype="auto", attn_implementation="eager")


def generated(response: httpx.Response, stream: bool) -> tuple[list[int], list[float], Any]:
    """(token ids, their logprobs, weight_version) of a completion, streamed or whole."""
    if not stream:
        body = response.json()
        choice = body["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"], body["weight_version"]
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]  # the range's own event has none
    ids = [token for c in choices for token in c["token_ids"]]
    logprobs = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
    return ids, logprobs, events[-1]["weight_version"]


@pytest.mark.parametrize("stream", [False, True])
def test_spans_say_exactly_which_version_made_each_token(model_dir, other_model_dir, stream):
    swap_at, tokens = 4, 9
    with held_engine(model_dir, after=swap_at) as (engine, slot):
        n = Node(engine, mode="in_place")
        try:
            n.serve(1)
            result: dict[str, httpx.Response] = {}
            request = threading.Thread(
                target=lambda: result.update(r=completion(n, max_tokens=tokens, stream=stream))
            )
            request.start()
            slot.wait_held(1)  # 4 tokens made by version 1, the 5th not begun
            reload = {"model": str(other_model_dir), "weight_version": 2}
            n.serve(2, lambda: httpx.post(f"{engine}/reload", json=reload))
            slot.go()
            request.join()
        finally:
            n.close()
    assert result["r"].status_code == 200
    ids, logprobs, versions = generated(result["r"], stream)
    assert versions == {"start": 1, "end": 2, "spans": [[0, 1], [swap_at, 2]]}
    first, second = load_direct(model_dir), load_direct(other_model_dir)
    before, after = ids[:swap_at], ids[swap_at:]
    assert len(ids) == tokens
    # each span's logprobs are exactly those of its version run on the same prefix
    assert logprobs[:swap_at] == direct_logprobs(first, PROMPT, before)
    assert logprobs[swap_at:] == direct_logprobs(second, PROMPT + before, after)
    # and the check can tell the versions apart
    assert logprobs[:swap_at] != direct_logprobs(second, PROMPT, before)
    assert logprobs[swap_at:] != direct_logprobs(first, PROMPT + before, after)


def stream_events(node: Node, body: dict[str, Any], arrived: threading.Event, count: int) -> list[str]:
    """The stream's data events; `arrived` is set once `count` of them arrived."""
    events = []
    with node.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) >= count:
                    arrived.set()
    return events


@pytest.mark.parametrize("mode", ["in_place", "quiesce"])
def test_abort_stale_ends_the_requests_a_swap_breaks_and_only_those(model_dir, other_model_dir, mode):
    held_at, tokens = 2, 6
    with held_engine(model_dir, after=held_at) as (engine, slot):
        n = Node(engine, mode=mode, abort_stale=True)
        try:
            n.serve(1)
            answers: dict[str, Any] = {}
            streaming = threading.Event()
            long = {"prompt": PROMPT, "max_tokens": 50, "temperature": 0, "logprobs": 0}
            requests = [
                threading.Thread(
                    target=lambda: answers.update(pinned=completion(n, {"exact": 1}, max_tokens=50))
                ),
                threading.Thread(
                    target=lambda: answers.update(
                        streamed=stream_events(
                            n, {**long, "stream": True, "weight_version": {"max": 1}}, streaming, held_at
                        )
                    )
                ),
                threading.Thread(
                    target=lambda: answers.update(kept=completion(n, {"min": 1}, max_tokens=tokens))
                ),
            ]
            for request in requests:
                request.start()
            slot.wait_held(3)
            assert streaming.wait(60)  # the tokens made before the engine holds went through
            reload = {"model": str(other_model_dir), "weight_version": 2}
            swap = threading.Thread(
                target=n.serve, args=(2, lambda: httpx.post(f"{engine}/reload", json=reload))
            )
            swap.start()
            # the engine saw both stale requests go (their upstream requests were closed)
            wait_until(lambda: aborted(engine) == 2, "the engine kept generating the stale requests")
            requests[0].join()
            requests[1].join()
            if mode == "in_place":
                swap.join()  # under the request version 2 satisfies, held after its 2 tokens
                slot.go()
            else:
                slot.go()  # the swap drains it first
                swap.join()
            requests[2].join()
            wait_until(lambda: httpx.get(f"{engine}/health").json()["generating"] == 0, "still generating")
            health = httpx.get(f"{engine}/health").json()
            metrics = n.client.get("/metrics").text
        finally:
            n.close()
    pinned = answers["pinned"]
    assert pinned.status_code == 410 and "retry-after" not in pinned.headers
    error = pinned.json()["error"]
    assert error["code"] == "WeightVersionGone" and error["retryable"] is False
    assert error["served"] == 1 and error["required"] == {"min": 1, "max": 1} and error["head"] is None
    assert "weight_version" not in pinned.json()
    events = answers["streamed"]
    assert events[-1] != "[DONE]"  # the stream ends with the error event
    chunks = [json.loads(e) for e in events]
    assert len(chunks) == held_at + 1 and all("weight_version" not in c for c in chunks)
    assert chunks[-1] == {"error": {**error, "required": {"min": None, "max": 1}}}
    # each stale request ran at most one more forward pass, not to its 50 tokens
    assert health["tokens"] <= tokens + 2 * (held_at + 1)
    assert 'deltaboard_sidecar_requests_total{outcome="stale"} 2.0' in metrics
    kept = answers["kept"]
    assert kept.status_code == 200 and len(kept.json()["choices"][0]["token_ids"]) == tokens
    if mode == "in_place":
        assert kept.json()["weight_version"] == {"start": 1, "end": 2, "spans": [[0, 1], [held_at, 2]]}
    else:
        assert kept.json()["weight_version"] == {"start": 1, "end": 1, "spans": [[0, 1]]}


def test_healthz_and_metrics(node):
    assert node.client.get("/healthz").json()["served"] == 1
    completion(node, {"exact": 1})
    completion(node, {"exact": 0})
    metrics = node.client.get("/metrics").text
    assert 'deltaboard_sidecar_requests_total{outcome="proxied"} 1.0' in metrics
    assert 'deltaboard_sidecar_requests_total{outcome="gone"} 1.0' in metrics
    assert "deltaboard_sidecar_served_version 1.0" in metrics


def test_healthz_is_503_before_any_version():
    n = Node("http://127.0.0.1:9")
    try:
        assert n.client.get("/healthz").status_code == 503
    finally:
        n.close()
