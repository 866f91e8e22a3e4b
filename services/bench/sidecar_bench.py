"""`deltaboard bench sidecar`: what the sidecar costs beside a fast engine, in one run.

Three kinds of processes on loopback:

* a **fake OpenAI-compatible engine** (`FastEngine`, raw asyncio, no model) that streams
  as fast as it can: each token its own event and its own socket write, the streams
  interleaved token by token as a batching engine emits them. It stamps its responses as
  the reference engine does (`X-Engine-Weight-Version`, `X-Engine-Load-Count`, `/health`,
  `/reload`), writes each token's version into its event (`"v"`), and reports the exact
  per-token `weight_version.spans` in its last event (or its one JSON body);
* the **sidecar** (`--workers` processes: by default `auto`, as deployed; the report's
  `workers` says how many ran), in `in_place` mode (swaps under running requests, as RL
  rollouts want), its owner swapping the engine's version every `swap_every_s` seconds
  for the whole run;
* the **load generator** (this process, on uvloop as the engine and the sidecar are: it
  shares their cores): the same load direct to the engine and through the sidecar:
  `streams` concurrent streams of `stream_tokens` tokens, the same streams paced, then
  `requests` concurrent non-streaming requests of `request_tokens` tokens, each for
  `duration_s`, with `weight_version: {"min": 0}` in every body.

The engine streams as fast as it can in the first phase: the engine, the sidecar and the
load generator then want more CPU than the machine may have, and a stream's first token
waits for a core as much as for the sidecar. The **paced** phase asks the engine for one
token per stream every `paced_step_ms` (`"step_ms"` in the body), as a GPU's decode steps
give them, so that the time to first token there is the sidecar's own hops through a
loop that is not saturated. Each phase also reports how many of the machine's cores were
busy (every process's, `busy_cores`) and the load generator's own CPU per token.

Every response through the sidecar is checked: its range and spans must be present
(`missing_stamps` counts those without) and match the versions the engine wrote into its
tokens (`errors` counts those that do not, and every failed request). Sidecar CPU is read
from the sidecar's processes (`psutil`: user + system time of the owner and its workers)
around each phase, so it counts the sidecar alone, whatever else shares the machine:
`sidecar_cpu_us_per_token` (streaming) and `sidecar_cpu_ms_per_request` (not streaming).
The added time to first token is the sidecar's p50/p99 minus the direct one's. The paced
phase's is also given without each client's first stream (`ttft_paced_warm_*`): that one
opens the client's connection and, through the sidecar, the sidecar's to the engine, and the
first streams of all the clients start at once, a burst of new connections that makes the
p99 of a short phase (docs/design.md).

The same load also goes through a **pass-through proxy** (`services.bench.passthrough`: a
process that passes bytes both ways and does nothing else), the floor under the sidecar's
figures: what one more process in the path costs on this machine (its wake-ups, reads,
writes and connections), with the sidecar's own work left out. Its figures are under
`passthrough` (requests/s, added time to first token, CPU per token and per request), and
`sidecar_paced_cpu_us_per_token` beside its `paced_cpu_us_per_token` gives the cost per
token at a GPU's pace, where each read of the engine brings one token.

With `own_core` (`--own-core`) the proxy under test runs alone on the last core, the
engine and the load generator on the others (`Cores`), as a sidecar beside a GPU engine
finds a core; `placement` reports the cores each process was found on after the phases.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import psutil
import uvloop
from rich.console import Console
from rich.table import Table

from deltaboard.services.bench.passthrough import passthrough_process
from deltaboard.services.sidecar.upstream import UpstreamError, UpstreamPool

Status = Callable[[str], None]
TOKEN_VERSION = re.compile(rb'"v":(\d+)')
PASSTHROUGH = "pass-through"  # the phases' name for the proxy that does nothing
NAMES = ("direct", PASSTHROUGH, "sidecar")  # each phase's load goes to these, in this order
TARGETS = {"sidecar_cpu_us_per_token": 15.0, "sidecar_cpu_ms_per_request": 0.5}  # issue 19


def auto_workers() -> int:
    """`deltaboard sidecar --workers auto`, its default (`workers.auto_workers`), so that the
    bench measures what is deployed; imported here, not by the module, which the fake
    engine's and the pass-through's processes import too."""
    from deltaboard.services.sidecar import workers

    return workers.auto_workers()


@dataclass(frozen=True)
class BenchConfig:
    duration_s: float = 20.0  # per phase and target
    streams: int = 64
    stream_tokens: int = 128
    requests: int = 256
    request_tokens: int = 16
    workers: int = field(default_factory=auto_workers)  # as `deltaboard sidecar` deploys by default
    swap_every_s: float = 3.0
    mode: str = "in_place"
    paced_step_ms: float = 10.0  # the engine's decode step in the paced phase
    # the proxy under test (the pass-through, the sidecar) alone on the machine's last core,
    # the engine and the load generator on the others (`Cores`)
    own_core: bool = False


def quick(workers: int | None = None) -> BenchConfig:
    """5 s a phase and a swap a second; `workers` None: `auto_workers()`, as deployed."""
    return BenchConfig(duration_s=5.0, workers=workers or auto_workers(), swap_every_s=1.0)


@dataclass(frozen=True)
class Cores:
    """Where `own_core` runs each process: the proxy under test on the last core this
    process may use, the engine and the load generator on the others. As deployed, the
    engine's work is on its GPU and the sidecar finds a core: the default run shares every
    core between the three, so that a woken proxy waits for one behind the engine and the
    generator, and its added time is the machine's queueing as much as the proxy's own
    (docs/design.md)."""

    proxy: frozenset[int]
    others: frozenset[int]

    @classmethod
    def split(cls) -> Cores:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            raise ValueError(
                f"a core of the proxy's own needs two cores or more; this process may use {len(cores)}"
            )
        return cls(frozenset(cores[-1:]), frozenset(cores[:-1]))


def on_cores(cores: frozenset[int] | None, target: Callable[..., None], *args: Any) -> None:
    """A process's entry point run on `cores` (None: where it was started); set in the
    process itself, before it starts any other (the sidecar's workers inherit it)."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    target(*args)


# --- the fake engine -------------------------------------------------------------------


class FastEngine:
    """An OpenAI-compatible stand-in that generates nothing and streams as fast as it can.

    `POST /v1/completions` (and `/v1/chat/completions`) with `max_tokens` and `stream`;
    `GET /health`, `POST /reload {"weight_version"}` as the reference engine answers them.
    A reload lands between two tokens (one event loop), so a stream may span it: its
    tokens say which version made each, and its spans say where it fell.
    """

    def __init__(self) -> None:
        self.version = 0
        self.loads = 1

    def _stamp(self) -> list[bytes]:
        return [
            b"x-engine-weight-version: %d\r\n" % self.version,
            b"x-engine-load-count: %d\r\n" % self.loads,
        ]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target = head.split(b" ", 2)[:2]
                length = 0
                for line in head.lower().split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                await self._answer(method, target.split(b"?")[0], body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.transport.abort()

    def _json(self, writer: asyncio.StreamWriter, payload: Any, status: bytes = b"200 OK") -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        head = [b"HTTP/1.1 ", status, b"\r\ncontent-type: application/json\r\n", *self._stamp()]
        writer.write(b"".join([*head, b"content-length: %d\r\n\r\n" % len(body), body]))

    async def _answer(self, method: bytes, path: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        if path == b"/health":
            self._json(writer, {"weight_version": self.version, "loads": self.loads})
        elif path == b"/reload":
            self.version = int(json.loads(body).get("weight_version") or 0)
            self.loads += 1
            self._json(writer, {"weight_version": self.version, "loads": self.loads})
        elif path in (b"/pause", b"/resume"):
            self._json(writer, {})
        elif path in (b"/v1/completions", b"/v1/chat/completions"):
            request = json.loads(body)
            tokens = int(request.get("max_tokens", 16))
            if request.get("stream"):
                await self._stream(writer, tokens, float(request.get("step_ms", 0)) / 1000)
            else:
                versions = [self.version] * tokens
                choice = {"index": 0, "text": " tok" * tokens, "v": versions}
                usage = {"completion_tokens": tokens}
                field = {"spans": spans_of(versions)}
                self._json(
                    writer,
                    {
                        "object": "text_completion",
                        "choices": [choice],
                        "usage": usage,
                        "weight_version": field,
                    },
                )
        elif method == b"GET" and path == b"/v1/models":
            self._json(writer, {"data": [{"id": "fake"}]})
        else:
            self._json(writer, {"error": "no route"}, b"404 Not Found")

    async def _stream(self, writer: asyncio.StreamWriter, tokens: int, step_s: float) -> None:
        head = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n", *self._stamp()]
        writer.write(b"".join([*head, b"transfer-encoding: chunked\r\n\r\n"]))
        versions = []
        for i in range(tokens):
            versions.append(self.version)
            event = (
                b'data: {"object":"text_completion","choices":[{"index":0,"text":" tok","v":%d}]'
                % self.version
            )
            if i == tokens - 1:
                field = json.dumps({"spans": spans_of(versions)}, separators=(",", ":")).encode()
                event += b',"weight_version":' + field
            event += b"}\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            if writer.transport.is_closing():
                return
            # the next stream's token, as an engine's batch step emits them (paced: the next step)
            await asyncio.sleep(step_s)
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def spans_of(versions: list[int]) -> list[list[int]]:
    """`weight_version.spans` of tokens made by `versions` (index of each change, version)."""
    spans: list[list[int]] = []
    for i, version in enumerate(versions):
        if not spans or spans[-1][1] != version:
            spans.append([i, version])
    return spans


async def _serve_engine(port: Connection) -> None:
    engine = FastEngine()
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0, backlog=4096)
    port.send(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


def engine_process(port: Connection) -> None:
    """Entry point of the engine's process: sends its port through `port`, then serves."""
    uvloop.run(_serve_engine(port))


# --- the sidecar under test ----------------------------------------------------------


def sidecar_process(engine_url: str, config: BenchConfig, port: Connection) -> None:
    """Entry point of the sidecar's (owner) process: a gate and proxy in front of the
    engine, sending its port through `port`, swapping the engine every `swap_every_s`."""
    from deltaboard.clients.engines import make_adapter
    from deltaboard.services.sidecar import workers
    from deltaboard.services.sidecar.background import listen
    from deltaboard.services.sidecar.metrics import SidecarMetrics
    from deltaboard.services.sidecar.proxy import ProxySettings, create_proxy_app

    sock = listen("127.0.0.1", 0)
    listening = sock.getsockname()[1]
    adapter = make_adapter("reference", engine_url)

    def build(gate: Any, metrics: SidecarMetrics, lifespan: Any) -> Any:
        status = lambda: {"served": gate.served, "healthy": gate.healthy}  # noqa: E731
        worker_adapter = make_adapter("reference", engine_url)
        return create_proxy_app(gate, worker_adapter, ProxySettings(engine_url), metrics, status, lifespan)

    def swapping(gate: Any, stop: threading.Event) -> None:
        version = 0
        gate.end_swap(version, 0.0, adapter.loaded())
        port.send(listening)
        while not stop.wait(config.swap_every_s):
            version += 1
            started = time.monotonic()
            gate.begin_swap(version)
            try:
                loaded = adapter.reload(os.devnull, version, gate.mode)  # type: ignore[arg-type]
            finally:
                gate.end_swap(version, time.monotonic() - started, loaded)

    workers.serve(sock, build, swapping, config.workers, config.mode, SidecarMetrics())  # type: ignore[arg-type]


# --- the load generator ---------------------------------------------------------------


@dataclass
class Phase:
    units: int = 0  # tokens (streams) or requests
    ttft_ms: list[float] = field(default_factory=list)
    warm_ttft_ms: list[float] = field(default_factory=list)  # each client's streams after its first
    latency_ms: list[float] = field(default_factory=list)
    errors: int = 0
    missing: int = 0
    cpu_s: float = 0.0  # the proxy's (the sidecar's, the pass-through's)
    engine_cpu_s: float = 0.0
    generator_cpu_s: float = 0.0  # this process's
    busy_cores: float = 0.0  # the machine's, every process's, on average over the phase
    elapsed_s: float = 0.0
    first_error: str | None = None


def _check(stamp: Any, versions: list[int], phase: Phase, through_sidecar: bool) -> None:
    """Count a response whose stamp is missing, or does not match its tokens' versions."""
    if not through_sidecar:
        return
    if not isinstance(stamp, dict) or stamp.get("start") is None or stamp.get("end") is None:
        phase.missing += 1
        return
    expected = spans_of(versions)
    ok = stamp["spans"] == expected and stamp["start"] <= versions[0] and versions[-1] <= stamp["end"]
    if not ok:
        phase.errors += 1
        phase.first_error = phase.first_error or f"stamp {stamp} for tokens of versions {expected}"


BODY = {"model": "fake", "prompt": [1, 2, 3], "weight_version": {"min": 0}}


async def _one_stream(pool: UpstreamPool, body: bytes, phase: Phase, sidecar: bool) -> float:
    """One stream read to its end and checked; its time to first token (ms)."""
    started = time.perf_counter()
    response = await pool.request("POST", "/v1/completions", [(b"content-type", b"application/json")], body)
    if response.status_code != 200:
        raise UpstreamError(f"{response.status_code}: {(await response.aread())[:200]!r}")
    parts = []
    ttft_ms = None
    async for part in response.aiter_raw():
        if ttft_ms is None:
            ttft_ms = (time.perf_counter() - started) * 1000
        parts.append(part)
    text = b"".join(parts)
    versions = [int(v) for v in TOKEN_VERSION.findall(text)]
    phase.units += len(versions)
    events = text.split(b"\n\n")
    last = next((e for e in reversed(events) if e.startswith(b"data: {")), b"")
    _check(json.loads(last[6:]).get("weight_version") if last else None, versions, phase, sidecar)
    if ttft_ms is None:
        raise UpstreamError("a stream without a body")
    return ttft_ms


async def _one_request(pool: UpstreamPool, body: bytes, phase: Phase, sidecar: bool) -> float:
    """One request answered and checked; its latency (ms)."""
    started = time.perf_counter()
    response = await pool.request("POST", "/v1/completions", [(b"content-type", b"application/json")], body)
    payload = await response.aread()
    if response.status_code != 200:
        raise UpstreamError(f"{response.status_code}: {payload[:200]!r}")
    latency_ms = (time.perf_counter() - started) * 1000
    answer = json.loads(payload)
    phase.units += 1
    _check(answer.get("weight_version"), answer["choices"][0]["v"], phase, sidecar)
    return latency_ms


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its children (the workers)."""
    process = psutil.Process(pid)
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _busy_s() -> float:
    """CPU seconds the machine's cores have spent busy (all of them, every process) or
    taken by the hypervisor (`steal`); guest time is already counted in `user`."""
    times = psutil.cpu_times()
    parts = ("user", "nice", "system", "irq", "softirq", "steal")
    return float(sum(getattr(times, part, 0.0) for part in parts))


async def _phase(
    url: str,
    stream: bool,
    config: BenchConfig,
    engine_pid: int,
    proxy_pid: int | None,
    stamped: bool,
    paced: bool = False,
) -> Phase:
    """One phase's load against `url`, with the CPU of the proxy process `proxy_pid` (the
    sidecar, the pass-through; None: direct) around it; `stamped`: check every response's stamp."""
    pool = UpstreamPool(url)
    tokens = config.stream_tokens if stream else config.request_tokens
    pace = {"step_ms": config.paced_step_ms} if paced else {}
    body = json.dumps({**BODY, "max_tokens": tokens, "stream": stream, **pace}).encode()
    phase = Phase()
    one = _one_stream if stream else _one_request
    concurrency = config.streams if stream else config.requests
    deadline = time.monotonic() + config.duration_s
    times, warm = (phase.ttft_ms, phase.warm_ttft_ms) if stream else (phase.latency_ms, [])

    async def client() -> None:
        opened = False  # the client's connection (and, through the sidecar, the sidecar's to the engine)
        while time.monotonic() < deadline:
            try:
                value = await one(pool, body, phase, stamped)
            except (UpstreamError, ValueError, KeyError) as exc:
                phase.errors += 1
                phase.first_error = phase.first_error or repr(exc)
                continue
            times.append(value)
            if opened:
                warm.append(value)
            opened = True

    cpu = _cpu_s(proxy_pid) if proxy_pid is not None else 0.0
    engine_cpu, generator_cpu, busy = _cpu_s(engine_pid), time.process_time(), _busy_s()
    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    phase.elapsed_s = time.monotonic() - started
    phase.cpu_s = _cpu_s(proxy_pid) - cpu if proxy_pid is not None else 0.0
    phase.engine_cpu_s = _cpu_s(engine_pid) - engine_cpu
    phase.generator_cpu_s = time.process_time() - generator_cpu
    phase.busy_cores = (_busy_s() - busy) / phase.elapsed_s
    await pool.aclose()
    return phase


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _quantiles(values: list[float]) -> list[float]:
    """[p50, p99] of a figure's values."""
    return [round(_pct(values, q), 2) for q in (0.5, 0.99)]


def _p50_p99(direct: list[float], sidecar: list[float]) -> dict[str, list[float]]:
    """[p50, p99] of a figure's values, direct and through the sidecar."""
    return {"direct": _quantiles(direct), "sidecar": _quantiles(sidecar)}


def _added_ms(direct: list[float], sidecar: list[float], q: float) -> float:
    return round(_pct(sidecar, q) - _pct(direct, q), 2)


def _per_token_us(cpu_s: float, phase: Phase) -> float:
    return round(cpu_s / max(phase.units, 1) * 1e6, 2)


def _through(phases: dict[str, Phase], proxy: str) -> dict[str, Any]:
    """What a proxy (`proxy`: the phases' name for it) gave and cost against direct."""
    direct_s, proxy_s = phases["streams, direct"], phases[f"streams, {proxy}"]
    direct_p, proxy_p = phases["paced streams, direct"], phases[f"paced streams, {proxy}"]
    proxy_r = phases[f"requests, {proxy}"]
    return {
        "tokens_per_s": round(proxy_s.units / proxy_s.elapsed_s),
        "rps": round(proxy_r.units / proxy_r.elapsed_s),
        "ttft_p50_added_ms": _added_ms(direct_s.ttft_ms, proxy_s.ttft_ms, 0.5),
        "ttft_p99_added_ms": _added_ms(direct_s.ttft_ms, proxy_s.ttft_ms, 0.99),
        "ttft_paced_p50_added_ms": _added_ms(direct_p.ttft_ms, proxy_p.ttft_ms, 0.5),
        "ttft_paced_p99_added_ms": _added_ms(direct_p.ttft_ms, proxy_p.ttft_ms, 0.99),
        "ttft_paced_warm_p50_added_ms": _added_ms(direct_p.warm_ttft_ms, proxy_p.warm_ttft_ms, 0.5),
        "ttft_paced_warm_p99_added_ms": _added_ms(direct_p.warm_ttft_ms, proxy_p.warm_ttft_ms, 0.99),
        "cpu_us_per_token": _per_token_us(proxy_s.cpu_s, proxy_s),
        # at a GPU's pace a read of the engine holds one token: the per-read cost, per token
        "paced_cpu_us_per_token": _per_token_us(proxy_p.cpu_s, proxy_p),
        "cpu_ms_per_request": round(proxy_r.cpu_s / max(proxy_r.units, 1) * 1e3, 3),
        "ttft_ms": _quantiles(proxy_s.ttft_ms),
        "paced_ttft_ms": _quantiles(proxy_p.ttft_ms),
        "latency_ms": _quantiles(proxy_r.latency_ms),
    }


def _summary(phases: dict[str, Phase], config: BenchConfig) -> dict[str, Any]:
    direct_s, sidecar_s = phases["streams, direct"], phases["streams, sidecar"]
    direct_p, sidecar_p = phases["paced streams, direct"], phases["paced streams, sidecar"]
    direct_r, sidecar_r = phases["requests, direct"], phases["requests, sidecar"]
    sidecar = _through(phases, "sidecar")
    return {
        "direct_tokens_per_s": round(direct_s.units / direct_s.elapsed_s),
        "sidecar_tokens_per_s": sidecar["tokens_per_s"],
        "direct_rps": round(direct_r.units / direct_r.elapsed_s),
        "sidecar_rps": sidecar["rps"],
        "ttft_p50_added_ms": sidecar["ttft_p50_added_ms"],
        "ttft_p99_added_ms": sidecar["ttft_p99_added_ms"],
        "ttft_paced_p50_added_ms": sidecar["ttft_paced_p50_added_ms"],
        "ttft_paced_p99_added_ms": sidecar["ttft_paced_p99_added_ms"],
        # the same without each client's first stream, whose connections open with it
        "ttft_paced_warm_p50_added_ms": sidecar["ttft_paced_warm_p50_added_ms"],
        "ttft_paced_warm_p99_added_ms": sidecar["ttft_paced_warm_p99_added_ms"],
        "sidecar_cpu_us_per_token": sidecar["cpu_us_per_token"],
        "sidecar_cpu_ms_per_request": sidecar["cpu_ms_per_request"],
        "sidecar_paced_cpu_us_per_token": sidecar["paced_cpu_us_per_token"],
        # the same figures through a proxy that does nothing (`services.bench.passthrough`):
        # what any process in the path costs on this machine, the floor the sidecar's stand on
        "passthrough": _through(phases, PASSTHROUGH),
        # the fake engine's own, direct: what a token or a request costs a minimal asyncio
        # server on the same machine at the same time, to read the sidecar's figures against
        "engine_cpu_us_per_token": _per_token_us(direct_s.engine_cpu_s, direct_s),
        "engine_cpu_ms_per_request": round(direct_r.engine_cpu_s / max(direct_r.units, 1) * 1e3, 3),
        # what the load generator costs (the same code direct and through the sidecar)
        "generator_cpu_us_per_token": {
            "direct": _per_token_us(direct_s.generator_cpu_s, direct_s),
            "sidecar": _per_token_us(sidecar_s.generator_cpu_s, sidecar_s),
        },
        "busy_cores": {name: round(phase.busy_cores, 2) for name, phase in phases.items()},
        "errors": sum(phase.errors for phase in phases.values()),
        "missing_stamps": sidecar_s.missing + sidecar_p.missing + sidecar_r.missing,
        "ttft_ms": _p50_p99(direct_s.ttft_ms, sidecar_s.ttft_ms),
        "paced": {
            "tokens_per_s": [round(p.units / p.elapsed_s) for p in (direct_p, sidecar_p)],
            "ttft_ms": _p50_p99(direct_p.ttft_ms, sidecar_p.ttft_ms),
            "warm_ttft_ms": _p50_p99(direct_p.warm_ttft_ms, sidecar_p.warm_ttft_ms),
        },
        "latency_ms": _p50_p99(direct_r.latency_ms, sidecar_r.latency_ms),
        "first_error": next((p.first_error for p in phases.values() if p.first_error), None),
        "workers": config.workers,  # the sidecar's worker processes that ran
        "cores": os.cpu_count(),
        "config": asdict(config),
    }


def run(config: BenchConfig, status: Status) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    cores = Cores.split() if config.own_core else None
    proxy_cores, other_cores = (cores.proxy, cores.others) if cores else (None, None)
    started_on = os.sched_getaffinity(0)
    engine_port, engine_end = context.Pipe()
    engine = context.Process(target=on_cores, args=(other_cores, engine_process, engine_end), daemon=True)
    engine.start()
    sidecar = passthrough = None
    try:
        if other_cores is not None:
            os.sched_setaffinity(0, other_cores)  # the load generator
        engine_url = f"http://127.0.0.1:{engine_port.recv()}"
        floor_port, floor_end = context.Pipe()
        passthrough = context.Process(
            target=on_cores, args=(proxy_cores, passthrough_process, engine_url, floor_end), daemon=True
        )
        passthrough.start()
        floor_url = f"http://127.0.0.1:{floor_port.recv()}"
        sidecar_port, sidecar_end = context.Pipe()
        sidecar = context.Process(
            target=on_cores, args=(proxy_cores, sidecar_process, engine_url, config, sidecar_end)
        )
        sidecar.start()
        deadline = time.monotonic() + 60
        while not sidecar_port.poll(0.1):
            if not sidecar.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the sidecar did not start")
        sidecar_url = f"http://127.0.0.1:{sidecar_port.recv()}"
        assert sidecar.pid is not None and engine.pid is not None and passthrough.pid is not None
        targets = (
            ("direct", engine_url, None),
            (PASSTHROUGH, floor_url, passthrough.pid),
            ("sidecar", sidecar_url, sidecar.pid),
        )
        phases = {}
        for what, stream, paced in (
            ("streams", True, False),
            ("paced streams", True, True),
            ("requests", False, False),
        ):
            for name, url, pid in targets:  # in the order of NAMES
                status(f"{what}, {name}")
                phase = _phase(url, stream, config, engine.pid, pid, name == "sidecar", paced)
                phases[f"{what}, {name}"] = uvloop.run(phase)
        report = _summary(phases, config)
        report["placement"] = _placement(engine.pid, passthrough.pid, sidecar.pid)
        return report
    finally:
        os.sched_setaffinity(0, started_on)
        for process in (sidecar, passthrough, engine):
            if process is not None:
                process.terminate()
                process.join(10)


def _placement(engine: int, passthrough: int, sidecar: int) -> dict[str, list[int]]:
    """The cores each process may run on, read from the processes after the phases (the
    sidecar's: its owner's and every worker's)."""
    processes = {"engine": [engine], PASSTHROUGH: [passthrough], "load generator": [os.getpid()]}
    owner = psutil.Process(sidecar)
    processes["sidecar"] = [sidecar, *(p.pid for p in owner.children(recursive=True))]
    return {name: sorted(set().union(*map(_affinity, pids))) for name, pids in processes.items()}


def _affinity(pid: int) -> set[int]:
    """The cores process `pid` may run on; none for one that has ended meanwhile."""
    try:
        return os.sched_getaffinity(pid)
    except ProcessLookupError:
        return set()


def _pair(values: list[float]) -> str:
    return f"{values[0]:.2f} / {values[1]:.2f}"


def render(report: dict[str, Any], console: Console) -> None:
    workers = report["config"]["workers"]
    placed = ", the proxy on a core of its own" if report["config"]["own_core"] else ""
    table = Table(
        title=f"sidecar beside a fast fake engine ({report['cores']} cores, {workers} worker(s){placed})"
    )
    for column in ("figure", "direct", "through a pass-through", "through the sidecar", "target"):
        table.add_column(column)
    ttft, latency, floor = report["ttft_ms"], report["latency_ms"], report["passthrough"]
    tokens = (report["direct_tokens_per_s"], floor["tokens_per_s"], report["sidecar_tokens_per_s"])
    table.add_row("tokens/s (streams)", *map(str, tokens), "")
    table.add_row(
        "TTFT p50 / p99 ms", _pair(ttft["direct"]), _pair(floor["ttft_ms"]), _pair(ttft["sidecar"]), ""
    )
    added = [[floor["ttft_p50_added_ms"], floor["ttft_p99_added_ms"]]]
    added.append([report["ttft_p50_added_ms"], report["ttft_p99_added_ms"]])
    table.add_row("TTFT added p50 / p99 ms", "", *map(_pair, added), "≤ 2 / ≤ 20")
    paced = report["paced"]
    step = report["config"]["paced_step_ms"]
    direct_rate, sidecar_rate = paced["tokens_per_s"]
    table.add_row(f"paced ({step} ms a token): tokens/s", str(direct_rate), "", str(sidecar_rate), "")
    table.add_row(
        "paced: TTFT p50 / p99 ms",
        _pair(paced["ttft_ms"]["direct"]),
        _pair(floor["paced_ttft_ms"]),
        _pair(paced["ttft_ms"]["sidecar"]),
        "",
    )
    warm = paced["warm_ttft_ms"]
    table.add_row("paced, connections open: same", _pair(warm["direct"]), "", _pair(warm["sidecar"]), "")
    busy = report["busy_cores"]
    phases = ("streams", "paced streams", "requests")
    table.add_row(
        "busy cores (streams, paced, requests)",
        *(" / ".join(f"{busy[f'{what}, {name}']:.2f}" for what in phases) for name in NAMES),
        f"of {report['cores']}",
    )
    generator = report["generator_cpu_us_per_token"]
    table.add_row("load generator CPU µs/token", str(generator["direct"]), "", str(generator["sidecar"]), "")
    rps = (report["direct_rps"], floor["rps"], report["sidecar_rps"])
    table.add_row("requests/s", *map(str, rps), "")
    table.add_row(
        "latency p50 / p99 ms",
        _pair(latency["direct"]),
        _pair(floor["latency_ms"]),
        _pair(latency["sidecar"]),
        "",
    )
    for key, floor_key, label in (
        ("sidecar_cpu_us_per_token", "cpu_us_per_token", "proxy CPU µs/token"),
        ("sidecar_cpu_ms_per_request", "cpu_ms_per_request", "proxy CPU ms/request"),
    ):
        table.add_row(label, "", str(floor[floor_key]), str(report[key]), f"≤ {TARGETS[key]}")
    paced_cpu = (floor["paced_cpu_us_per_token"], report["sidecar_paced_cpu_us_per_token"])
    table.add_row("paced: proxy CPU µs/token", "", *map(str, paced_cpu), "")
    table.add_row(
        "errors / missing stamps", "", "", f"{report['errors']} / {report['missing_stamps']}", "0 / 0"
    )
    console.print(table)
    if report.get("first_error"):
        console.print(f"first error: {report['first_error']}")
