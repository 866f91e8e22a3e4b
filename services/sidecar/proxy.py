"""The sidecar's HTTP app: version-checked proxying of the engine's inference routes.

Only the routes the engine adapter names as inference (`EngineAdapter.inference_routes`:
completions, chat completions, models, and per engine kind what it documents, such as
SGLang's `/generate`) reach the engine; any other path gets a JSON 404 (a known path
with another method, 405) from the sidecar itself. The engine's control routes (reload,
pause, ...) are the sidecar's alone: a client that could reach them could make a response
carry one version while other weights generated it.

Each request goes through `VersionGate.admit` (served / wait / 409 / 410), is forwarded
with its `weight_version` removed, and comes back with the version range it was served
with:

- headers `X-Weight-Version-Start` and `X-Weight-Version-End` (a stream's headers carry
  the end only when the gate holds its version until the request is done: `quiesce`
  mode, or a request pinned at the served version; otherwise the last event says),
- a JSON object body gains `"weight_version": {"start": s, "end": e, "spans": ...}`
  (which version made which token: `services.sidecar.stamping`),
- a stream passes as it comes and ends with an event of the sidecar's own carrying the
  same field (`data: {"choices": [], "weight_version": ...}`), its last data event, just
  before `data: [DONE]`.

With `VersionGate.abort_stale` (`deltaboard sidecar --abort-stale`), a swap aborts the
requests in flight that the new version would break instead of waiting for them
(`services.sidecar.gate`): a request not answered yet gets 410 `WeightVersionGone`, a
stream already under way ends with `data: {"error": {"code": "WeightVersionGone", ...}}`,
and the upstream request is closed, so the engine stops generating it.

Before stamping, the proxy asks the gate to vouch for the weights (`VersionGate.vouch`):
the engine's stamp, from the response's own headers where the engine stamps responses
(the reference engine: `X-Engine-Weight-Version`, `X-Engine-Load-Count`) or else from
the adapter's `stamp_path` asked right after the response, must be a load the sidecar
made since the request was admitted. A stream is checked at its start (headers) and
again after its last event (the path). A response that is not vouched for is refused:
503 `EngineChanged` with `Retry-After`, or, for a stream already under way, a last
event `{"error": {"code": "EngineChanged", ...}}` in place of the range; likewise a
stream the engine breaks off ends with `{"error": {"code": "EngineUnavailable", ...}}`.

A client that disconnects cancels the upstream request (the engine sees the
disconnect and stops generating); an engine that cannot be reached gives 503 with
`Retry-After`. The engine's `Date` and `Server` headers are dropped (the sidecar's server
sends its own), so a response carries one of each. The sidecar's own routes are
`/healthz`, `/metrics`, `/sidecar/status` and its status page `/ui` (`sidecar.ui`).

The inference routes take a lean path (`InferenceRoutes`, a raw ASGI layer in front of
the FastAPI app that serves everything else): the body is read once and parsed only
when it names `weight_version` (a request whose headers carry its constraint is not
parsed at all), a request whose constraint holds is admitted without waiting on the
gate's lock (`VersionGate.admit_now`), the upstream is the sidecar's own connection pool
(`services.sidecar.upstream`), a stream's bytes go out as each read of the engine brings
them, nothing held back, written from the upstream connection's callback up to the
stream's end (`restamped_stream` with the server's sink), bodies are stamped by splicing bytes, the
engine's stamp is asked once for all the requests that need it in a turn of the loop
(`Proxy.engine_stamp`), and a client's disconnect cancels its request's work (`_Watch`:
told by the sidecar's server, `services.sidecar.server`, which also answers in one write
and ends a stream's body with its last event). Figures, before and after, in
docs/design.md.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from deltaboard.clients.engines import EngineAdapter, EngineStamp
from deltaboard.services.sidecar.constraints import (
    BODY_KEY,
    HEADER_PREFIX,
    ConstraintError,
    SidecarCode,
    VersionConstraint,
    parse_constraint,
)
from deltaboard.services.sidecar.deadline import Deadline
from deltaboard.services.sidecar.gate import Admitted, Refused, Stale, VersionGate, unless_stale
from deltaboard.services.sidecar.metrics import SidecarMetrics
from deltaboard.services.sidecar.server import DISCONNECT, SINK
from deltaboard.services.sidecar.stamping import (
    Release,
    cut_field,
    error_event,
    range_headers,
    restamped_stream,
    stamp,
)
from deltaboard.services.sidecar.upstream import (
    ResponseHeaders,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
# Besides hop-by-hop headers: the body is passed decoded, and `date` and `server` are the
# sidecar's server's own (it adds them to every response).
RESPONSE_DROP = HOP_BY_HOP | {"content-encoding", "date", "server"}
# The engine is asked for bodies as they are (no `accept-encoding`): the proxy stamps them.
_REQUEST_DROP = frozenset(name.encode() for name in HOP_BY_HOP | {"accept-encoding"})
_RESPONSE_DROP = frozenset(name.encode() for name in RESPONSE_DROP)
_PREFIX = HEADER_PREFIX.encode()
_BODY_KEY = b'"' + BODY_KEY.encode() + b'"'
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
ENGINE_RETRY_AFTER_S = 2

# The sidecar's one table from error code to HTTP status, and to the requests metric's label.
HTTP_STATUS: dict[SidecarCode, int] = {
    SidecarCode.BAD_WEIGHT_VERSION: 400,
    SidecarCode.NOT_FOUND: 404,
    SidecarCode.METHOD_NOT_ALLOWED: 405,
    SidecarCode.WEIGHT_VERSION_NOT_READY: 409,
    SidecarCode.WEIGHT_VERSION_GONE: 410,
    SidecarCode.BODY_TOO_LARGE: 413,
    SidecarCode.ENGINE_UNAVAILABLE: 503,
    SidecarCode.ENGINE_CHANGED: 503,
    SidecarCode.BAD_REQUEST: 400,  # answered by the server (`sidecar.server`), not the proxy
    SidecarCode.INTERNAL: 500,  # likewise
}
OUTCOME: dict[SidecarCode, str] = {
    SidecarCode.WEIGHT_VERSION_NOT_READY: "not_ready",
    SidecarCode.WEIGHT_VERSION_GONE: "gone",
    SidecarCode.ENGINE_UNAVAILABLE: "unavailable",
}
STAMP_TIMEOUT_S = 10.0
WATCH_AFTER_S = 0.05


@dataclass(frozen=True)
class ProxySettings:
    engine_url: str
    default_wait_s: float = 30.0
    max_wait_s: float = 300.0
    engine_timeout_s: float = 600.0  # for a whole answer, or a stream's first byte
    max_body_bytes: int = 64 * 2**20  # prompts, not uploads: a bigger body is refused (413)


def _error(
    code: SidecarCode,
    message: str,
    retry_after: int | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    headers = {**(headers or {}), **({"Retry-After": str(retry_after)} if retry_after is not None else {})}
    body = {"error": {"code": str(code), "message": message, **extra}}
    return JSONResponse(body, status_code=HTTP_STATUS[code], headers=headers)


def _not_routed(method: str, path: str, routes: frozenset[tuple[str, str]]) -> JSONResponse:
    """The sidecar's answer to a request it does not pass to the engine."""
    allowed = sorted(m for m, p in routes if p == path)
    if allowed:
        message = f"{method} {path} is not served here; use {', '.join(allowed)}"
        return _error(SidecarCode.METHOD_NOT_ALLOWED, message, headers={"Allow": ", ".join(allowed)})
    served = ", ".join(f"{m} {p}" for m, p in sorted(routes, key=lambda r: (r[1], r[0])))
    message = f"no route {path}: the sidecar passes only the engine's inference routes ({served})"
    return _error(SidecarCode.NOT_FOUND, message)


def _engine_changed(stamp: EngineStamp | str, gate: VersionGate) -> str:
    """Why a response is not stamped: the gate did not vouch for `stamp`, or (a string)
    what the engine holds cannot be told."""
    if isinstance(stamp, str):
        return f"cannot tell what the engine holds ({stamp}): the response is not stamped"
    return (
        f"the engine reports {stamp}, not weights this sidecar loaded since the request was "
        f"admitted (its last load: {gate.engine}): the response is not stamped"
    )


def _refusal(refused: Refused) -> JSONResponse:
    extra = {k: v for k, v in refused.error().items() if k not in ("code", "message")}
    return _error(refused.code, refused.message, refused.retry_after_s, **extra)


async def _read_body(receive: Receive, declared: bytes | None, limit: int) -> bytes | None:
    """The request body, or None when it exceeds `limit` (read no further than that)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body if len(body) <= limit else None
    parts, size = [body], len(body)
    while message.get("more_body"):
        message = await receive()
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
    return b"".join(parts)


def _response_headers(upstream: ResponseHeaders, extra: dict[str, str]) -> list[tuple[bytes, bytes]]:
    headers = [(name, value) for name, value in upstream.raw if name not in _RESPONSE_DROP]
    headers += [(name.lower().encode(), value.encode()) for name, value in extra.items()]
    return headers


class _Watch:
    """A request's watch for its client going away: a client that disconnects while the
    request waits for its admission or its answer cancels that work (the upstream closes
    with it: the engine stops generating). The sidecar's server says so itself (the scope's
    `DISCONNECT` extension: no task, no timer); under another server a watcher task waits
    in `receive` from the request's `WATCH_AFTER_S` on (most answers are done before, and
    a task per request is a good part of a short request's cost; a client that leaves
    sooner is noticed then). A request waiting at a swap costs no task of its own either."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.task = asyncio.current_task()
        self.active = True
        self.disconnected = False
        self._receive = receive
        self._watcher: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        notify = scope.get("extensions", {}).get(DISCONNECT)
        if notify is not None:
            notify(self._gone)
        else:
            self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._gone()

    def _gone(self) -> None:
        if self.active and self.task is not None:
            self.disconnected = True
            self.task.cancel()

    def stop(self) -> None:
        self.active = False
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


class InferenceRoutes:
    """The sidecar's ASGI app: the engine's inference routes are served here, in front of
    any framework (see the module docstring); everything else (the sidecar's own routes,
    the answers to routes it does not pass, the lifespan) goes to `app`, a FastAPI app."""

    def __init__(self, app: FastAPI, proxy: Proxy) -> None:
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) in self.proxy.routes:
            await self.proxy.handle(scope, receive, send)
        else:
            await self.app(scope, receive, send)


class Proxy:
    """Version-checked forwarding of one request to the engine."""

    def __init__(
        self, gate: VersionGate, adapter: EngineAdapter, settings: ProxySettings, metrics: SidecarMetrics
    ) -> None:
        self.gate = gate
        self.adapter = adapter
        self.settings = settings
        self.metrics = metrics
        self.routes = adapter.inference_routes
        self.pool = UpstreamPool(settings.engine_url)
        self._asking: asyncio.Future[EngineStamp | str] | None = None  # the next stamp question

    def count(self, outcome: str) -> None:
        self.metrics.count(outcome)

    async def engine_stamp(self, headers: ResponseHeaders | None) -> EngineStamp | str:
        """What the engine reports it holds: from `headers` if it stamped them, else asked
        at the adapter's `stamp_path` (a string says why it cannot be told) by a question
        sent after this call."""
        stamp = None if headers is None else self.adapter.stamp_of(headers)
        if stamp is not None:
            return stamp
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ask_stamp())
        return await asyncio.shield(self._asking)

    async def _ask_stamp(self) -> EngineStamp | str:
        """The engine's stamp asked at `stamp_path`, once for every request that asked
        before this task's first step (in the same turn of the event loop): the question
        goes out after each of them asked, so its answer holds for each, and a stream's
        end costs the engine and the sidecar one question per turn, not one per stream.
        Whoever asks from this step on waits for the next question."""
        self._asking = None
        path = self.adapter.stamp_path
        try:
            with Deadline(STAMP_TIMEOUT_S):  # one timer, where `asyncio.timeout` moves it twice
                status, body = await self.pool.get(path)
        except (UpstreamError, TimeoutError) as exc:
            return f"GET {path}: {exc!r}"
        if status != 200:
            return f"GET {path} answered {status}"
        try:
            return self.adapter.parse_stamp(json.loads(body))
        except ValueError as exc:
            return f"GET {path}: {exc}"

    async def vouched(self, headers: ResponseHeaders | None, admission: Admitted) -> str | None:
        """None when the gate vouches for the weights behind a response, else why not."""
        return await self.vouched_for(await self.engine_stamp(headers), admission)

    async def vouched_for(self, stamp: EngineStamp | str, admission: Admitted) -> str | None:
        """None when the gate vouches for `stamp` (what the engine reports it holds, or why
        that cannot be told) for a response of `admission`, else why not."""
        if isinstance(stamp, EngineStamp) and await self.gate.vouch(stamp, admission):
            return None
        self.count("engine_changed")
        return _engine_changed(stamp, self.gate)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.settings.max_body_bytes
        forward: list[tuple[bytes, bytes]] = []
        named: dict[str, str] = {}
        content_type = declared = None
        for name, value in scope["headers"]:
            if name.startswith(_PREFIX):
                named[name.decode("latin-1")] = value.decode("latin-1")
                continue
            if name == b"content-length":
                declared = value
            elif name == b"content-type":
                content_type = value
            if name not in _REQUEST_DROP:
                forward.append((name, value))
        raw = await _read_body(receive, declared, limit)
        if raw is None:
            self.count("bad_request")
            message = f"request bodies are limited to {limit} bytes"
            return await _error(SidecarCode.BODY_TOO_LARGE, message)(scope, receive, send)
        body: Any = None
        if raw.find(_BODY_KEY) >= 0 and (content_type is None or content_type.find(b"json") >= 0):
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        try:
            constraint, stripped = parse_constraint(body, named)
        except ConstraintError as exc:
            self.count("bad_request")
            return await _error(SidecarCode.BAD_WEIGHT_VERSION, str(exc))(scope, receive, send)
        if stripped is not body:
            raw = cut_field(raw) or json.dumps(stripped).encode()
        watch = _Watch(scope, receive)
        try:
            await self._admit(scope, receive, send, constraint, forward, raw)
        except asyncio.CancelledError:
            if not watch.disconnected or watch.task is None:
                raise
            watch.task.uncancel()
            self.count("aborted")
        finally:
            watch.stop()

    async def _admit(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        constraint: VersionConstraint,
        headers: list[tuple[bytes, bytes]],
        raw: bytes,
    ) -> None:
        """Admit the request (at once, or once its constraint holds) and pass it on, or
        answer the refusal; a client that leaves meanwhile cancels this (`_Watch`)."""
        admission: Admitted | Refused | None = self.gate.admit_now(constraint)
        if admission is None:
            default = self.settings.default_wait_s
            wait_s = min(
                constraint.wait_s if constraint.wait_s is not None else default, self.settings.max_wait_s
            )
            admission = await self.gate.admit(constraint, wait_s)
        if isinstance(admission, Refused):
            self.count(OUTCOME[admission.code])
            return await _refusal(admission)(scope, receive, send)
        self.metrics.waited(admission.waited_s)
        target = scope["raw_path"]
        if scope["query_string"]:
            target += b"?" + scope["query_string"]
        await self._forward(scope, receive, send, target.decode("latin-1"), headers, raw, admission)

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        target: str,
        headers: list[tuple[bytes, bytes]],
        raw: bytes,
        admission: Admitted,
    ) -> None:
        """Pass the admitted request on, and its answer back stamped; the upstream is
        closed and the admission released whatever happens."""
        release = Release(self.gate, admission)
        upstream: list[UpstreamResponse] = []
        try:
            await self._exchange(scope, receive, send, target, headers, raw, admission, release, upstream)
        finally:
            if upstream:
                await upstream[0].aclose()
            await release()

    async def _exchange(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        target: str,
        headers: list[tuple[bytes, bytes]],
        raw: bytes,
        admission: Admitted,
        release: Release,
        opened: list[UpstreamResponse],
    ) -> None:
        abortable = admission.high is not None  # only such a request can go stale
        start = admission.start
        try:
            with Deadline(self.settings.engine_timeout_s) as deadline:
                sending = self.pool.request(scope["method"], target, headers, raw)
                upstream = await (unless_stale(sending, admission) if abortable else sending)
                opened.append(upstream)
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    deadline.clear()  # a stream lasts as long as its client reads it
                    return await self._stream(scope, receive, send, upstream, admission, release)
                reading = upstream.aread()
                content = await (unless_stale(reading, admission) if abortable else reading)
        except Stale as stale:
            self.count("stale")
            return await _refusal(stale.refused)(scope, receive, send)
        except (UpstreamError, TimeoutError) as exc:
            self.count("engine_unavailable")
            message = f"engine unreachable: {exc!r}"
            unavailable = _error(SidecarCode.ENGINE_UNAVAILABLE, message, ENGINE_RETRY_AFTER_S)
            return await unavailable(scope, receive, send)
        refusal = await self.vouched(upstream.headers, admission)
        if refusal is not None:
            response = _error(SidecarCode.ENGINE_CHANGED, refusal, ENGINE_RETRY_AFTER_S)
            return await response(scope, receive, send)
        end = await release()
        if "json" in upstream.headers.get("content-type", ""):
            content = stamp(content, start, end) or content
        out = _response_headers(upstream.headers, range_headers(start, end))
        out.append((b"content-length", str(len(content)).encode()))
        self.count("proxied")
        await send({"type": "http.response.start", "status": upstream.status_code, "headers": out})
        await send({"type": "http.response.body", "body": content})

    async def _stream(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        upstream: UpstreamResponse,
        admission: Admitted,
        release: Release,
    ) -> None:
        stamped = self.adapter.stamp_of(upstream.headers)
        if stamped is not None:
            refusal = await self.vouched_for(stamped, admission)
            if refusal is not None:
                response = _error(SidecarCode.ENGINE_CHANGED, refusal, ENGINE_RETRY_AFTER_S)
                return await response(scope, receive, send)
        start = admission.start
        held = self.gate.holds_until_done(admission)
        out = _response_headers(upstream.headers, range_headers(start, start if held else None))
        self.count("proxied")
        await send({"type": "http.response.start", "status": upstream.status_code, "headers": out})
        sink = scope.get("extensions", {}).get(SINK) if upstream.chunked else None
        events = restamped_stream(
            upstream,
            admission,
            release,
            lambda: self.vouched(None, admission),
            lambda: self.count("stale"),
            sink,
        )
        last = False
        try:
            async for part in events:
                # the range given and the engine's answer read to its end: this part is the
                # last, and the body's end goes out in the same write
                last = release.done and upstream.ended
                await send({"type": "http.response.body", "body": part, "more_body": not last})
        except UpstreamError as exc:
            # the engine broke off (closed, or framed its answer wrongly) after the head went
            # out, so no 503 can be sent: the stream ends with the error as its last event
            # (whole events only went out before it), as a stale one does
            self.count("engine_unavailable")
            ended = error_event(SidecarCode.ENGINE_UNAVAILABLE, f"the engine's stream broke off: {exc}")
            await send({"type": "http.response.body", "body": ended})
            return
        if not last:
            await send({"type": "http.response.body", "body": b""})


def create_proxy_app(
    gate: VersionGate,
    adapter: EngineAdapter,
    settings: ProxySettings,
    metrics: SidecarMetrics,
    status: Callable[[], dict[str, Any]],
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> InferenceRoutes:
    proxy = Proxy(gate, adapter, settings, metrics)

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan(app) if lifespan is not None else nullcontext():
            yield
        await proxy.pool.aclose()

    app = FastAPI(title="deltaboard sidecar", lifespan=run, openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        body = status()
        ok = body["served"] is not None and body["healthy"]
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics.fleet is not None:  # one worker of several: the owner answers for all
            body = await asyncio.to_thread(metrics.fleet)
        else:
            body = metrics.exposition(gate.served, gate.head, gate.inflight)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/sidecar/status")
    async def sidecar_status() -> dict[str, Any]:
        return {**status(), "pins": gate.pins()}

    @app.api_route("/{path:path}", methods=METHODS)
    async def not_routed(path: str, request: Request) -> Response:
        """Whatever is not an inference route of the engine (those never get here)."""
        metrics.count("not_found")
        return _not_routed(request.method, "/" + path, adapter.inference_routes)

    return InferenceRoutes(app, proxy)
