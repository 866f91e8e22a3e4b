"""Stamps under load: many concurrent requests, streamed and not, through one sidecar while
its engine is swapped again and again. Every response's range and per-token spans must
match the versions the engine says made its tokens (the fake engine writes each token's
version into it), in `in_place` mode (swaps under running requests) and in `quiesce` mode
(start == end, every token of that version)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from deltaboard.clients.engines import CommitMode, make_adapter
from deltaboard.services.bench.sidecar_bench import spans_of
from deltaboard.services.sidecar.background import BackgroundServer
from deltaboard.services.sidecar.gate import VersionGate
from deltaboard.services.sidecar.metrics import SidecarMetrics
from deltaboard.services.sidecar.proxy import ProxySettings, create_proxy_app
from tests.services.fakes.fast_engine import fast_engine

STREAMS = 24  # concurrent clients of each kind
ROUNDS = 4  # requests of each client, at least
SWAPS = 8  # and then on until this many swaps happened
BODY = {"prompt": [1, 2, 3], "weight_version": {"min": 0}}


class Swapper:
    """Swaps the engine to the next version, under the gate, until stopped."""

    def __init__(self, gate: VersionGate, url: str) -> None:
        self.gate = gate
        self.adapter = make_adapter("reference", url)
        self.swaps = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def swap(self, version: int) -> None:
        self.gate.begin_swap(version)
        try:
            loaded = self.adapter.reload(os.devnull, version, self.gate.mode)  # type: ignore[arg-type]
        finally:
            self.gate.end_swap(version, 0.0, loaded)

    def run(self) -> None:
        while not self.stop.wait(0.005):
            self.swaps += 1
            self.swap(self.swaps)


def check(stamp: dict[str, Any], versions: list[int], headers: httpx.Headers, mode: CommitMode) -> None:
    assert versions, "no tokens"
    assert stamp["spans"] == spans_of(versions), (stamp, versions)
    assert stamp["start"] <= versions[0] and versions[-1] <= stamp["end"], (stamp, versions)
    assert headers["x-weight-version-start"] == str(stamp["start"])
    if mode == "quiesce":
        assert stamp["start"] == stamp["end"] == versions[0] == versions[-1]


async def load(url: str, swapper: Swapper, mode: CommitMode) -> tuple[int, set[int]]:
    """Streams and plain requests from concurrent clients, `ROUNDS` each and on until
    `SWAPS` swaps happened; returns how many responses were checked and the versions
    they saw."""
    seen: set[int] = set()
    checked = 0

    async def stream(client: httpx.AsyncClient) -> None:
        nonlocal checked
        body = {**BODY, "max_tokens": 24, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            text = b"".join([part async for part in response.aiter_bytes()])
        events = [e[6:] for e in text.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        payloads = [json.loads(e) for e in events[:-1]]
        versions = [p["choices"][0]["v"] for p in payloads[:-1]]
        assert all("weight_version" not in p for p in payloads[:-1])
        assert payloads[-1]["choices"] == []  # the range's own event, after the last token
        check(payloads[-1]["weight_version"], versions, response.headers, mode)
        seen.update(versions)
        checked += 1

    async def plain(client: httpx.AsyncClient) -> None:
        nonlocal checked
        response = await client.post("/v1/completions", json={**BODY, "max_tokens": 8})
        assert response.status_code == 200
        answer = response.json()
        versions = answer["choices"][0]["v"]
        check(answer["weight_version"], versions, response.headers, mode)
        assert response.headers["x-weight-version-end"] == str(answer["weight_version"]["end"])
        seen.update(versions)
        checked += 1

    async def client(one: Any) -> None:
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            for _ in range(ROUNDS):
                await one(http)
            while swapper.swaps < SWAPS:
                await one(http)

    await asyncio.gather(*(client(one) for one in (stream, plain) for _ in range(STREAMS)))
    return checked, seen


@pytest.mark.parametrize("mode", ["in_place", "quiesce"])
def test_stamps_stay_exact_under_concurrent_load_across_swaps(mode: CommitMode) -> None:
    gate = VersionGate(mode, drain_timeout_s=60)

    @asynccontextmanager
    async def bind(app: Any) -> Any:
        gate.bind(asyncio.get_running_loop())
        yield

    with fast_engine() as engine_url:
        adapter = make_adapter("reference", engine_url)
        status = lambda: {"served": gate.served, "healthy": gate.healthy}  # noqa: E731
        app = create_proxy_app(gate, adapter, ProxySettings(engine_url), SidecarMetrics(), status, bind)
        with BackgroundServer(app) as server:
            swapper = Swapper(gate, engine_url)
            swapper.swap(0)
            swapper.thread.start()
            try:
                checked, seen = asyncio.run(load(server.url, swapper, mode))
            finally:
                swapper.stop.set()
                swapper.thread.join(30)
    assert checked >= 2 * STREAMS * ROUNDS
    assert len(seen) >= 2  # the responses span several versions: the swaps fell among them
