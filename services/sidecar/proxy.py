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
- a stream's last data event (the one before `data: [DONE]`) gains the same field.

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
event `{"error": {"code": "EngineChanged", ...}}` in place of the range.

A client that disconnects cancels the upstream request (the engine sees the
disconnect and stops generating); an engine that cannot be reached gives 503 with
`Retry-After`. The engine's `Date` and `Server` headers are dropped (the sidecar's server
sends its own), so a response carries one of each. The sidecar's own routes are
`/healthz`, `/metrics`, `/sidecar/status` and its status page `/ui` (`sidecar.ui`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deltaboard.clients.engines import EngineAdapter, EngineStamp
from deltaboard.services.sidecar.background import unless_disconnected
from deltaboard.services.sidecar.constraints import (
    HEADER_PREFIX,
    ConstraintError,
    SidecarCode,
    parse_constraint,
)
from deltaboard.services.sidecar.gate import Admitted, Refused, Stale, VersionGate, unless_stale
from deltaboard.services.sidecar.metrics import SidecarMetrics
from deltaboard.services.sidecar.stamping import (
    Release,
    StampedStream,
    range_headers,
    restamped_stream,
    stamp,
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
}
OUTCOME: dict[SidecarCode, str] = {
    SidecarCode.WEIGHT_VERSION_NOT_READY: "not_ready",
    SidecarCode.WEIGHT_VERSION_GONE: "gone",
    SidecarCode.ENGINE_UNAVAILABLE: "unavailable",
}
STAMP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ProxySettings:
    engine_url: str
    default_wait_s: float = 30.0
    max_wait_s: float = 300.0
    engine_timeout_s: float = 600.0
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


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None when it exceeds `limit` (read no further than that)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
    return b"".join(parts)


def _forward_headers(request: Request) -> dict[str, str]:
    return {
        k: v
        for k, v in request.headers.items()
        if k.lower() not in HOP_BY_HOP and not k.lower().startswith(HEADER_PREFIX)
    }


def _response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in RESPONSE_DROP}


def create_proxy_app(
    gate: VersionGate,
    adapter: EngineAdapter,
    settings: ProxySettings,
    metrics: SidecarMetrics,
    status: Callable[[], dict[str, Any]],
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    client = httpx.AsyncClient(
        base_url=settings.engine_url.rstrip("/"),
        timeout=httpx.Timeout(settings.engine_timeout_s, connect=5.0),
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
    )

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan(app) if lifespan is not None else nullcontext():
            yield
        await client.aclose()

    app = FastAPI(title="deltaboard sidecar", lifespan=run, openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        body = status()
        ok = body["served"] is not None and body["healthy"]
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.served.set(gate.served if gate.served is not None else -1)
        metrics.head.set(gate.head if gate.head is not None else -1)
        metrics.inflight.set(gate.inflight)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/sidecar/status")
    async def sidecar_status() -> dict[str, Any]:
        return {**status(), "pins": gate.pins()}

    async def engine_stamp(headers: httpx.Headers | None) -> EngineStamp | str:
        """What the engine reports it holds: from `headers` if it stamped them, else asked
        at the adapter's `stamp_path` (a string says why it cannot be told)."""
        stamp = None if headers is None else adapter.stamp_of(headers)
        if stamp is not None:
            return stamp
        answer = await client.get(adapter.stamp_path, timeout=STAMP_TIMEOUT_S)
        if answer.status_code != 200:
            return f"GET {adapter.stamp_path} answered {answer.status_code}"
        try:
            return adapter.parse_stamp(answer.json())
        except ValueError as exc:
            return f"GET {adapter.stamp_path}: {exc}"

    async def vouched(headers: httpx.Headers | None, admission: Admitted) -> str | None:
        """None when the gate vouches for the weights behind a response, else why not."""
        stamp = await engine_stamp(headers)
        if isinstance(stamp, EngineStamp) and await gate.vouch(stamp, admission):
            return None
        metrics.requests.labels("engine_changed").inc()
        return _engine_changed(stamp, gate)

    @app.api_route("/{path:path}", methods=METHODS)
    async def proxy(path: str, request: Request) -> Response:
        if (request.method, "/" + path) not in adapter.inference_routes:
            metrics.requests.labels("not_found").inc()
            return _not_routed(request.method, "/" + path, adapter.inference_routes)
        raw = await _read_body(request, settings.max_body_bytes)
        if raw is None:
            metrics.requests.labels("bad_request").inc()
            return _error(
                SidecarCode.BODY_TOO_LARGE, f"request bodies are limited to {settings.max_body_bytes} bytes"
            )
        body: Any = None
        if raw and "json" in request.headers.get("content-type", "json"):
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        try:
            constraint, stripped = parse_constraint(body, request.headers)
        except ConstraintError as exc:
            metrics.requests.labels("bad_request").inc()
            return _error(SidecarCode.BAD_WEIGHT_VERSION, str(exc))
        if stripped is not body:
            raw = json.dumps(stripped).encode()
        wait_s = min(
            constraint.wait_s if constraint.wait_s is not None else settings.default_wait_s,
            settings.max_wait_s,
        )

        admitted, admission = await unless_disconnected(request, gate.admit(constraint, wait_s))
        if not admitted:
            metrics.requests.labels("aborted").inc()
            return Response(status_code=499)
        if isinstance(admission, Refused):
            metrics.requests.labels(OUTCOME[admission.code]).inc()
            return _refusal(admission)
        assert isinstance(admission, Admitted)
        metrics.wait_seconds.observe(admission.waited_s)
        return await _forward(request, path, raw, admission)

    async def _forward(request: Request, path: str, raw: bytes, admission: Admitted) -> Response:
        start = admission.start
        release = Release(gate, admission)
        upstream_request = client.build_request(
            request.method,
            "/" + path,
            params=list(request.query_params.multi_items()),
            headers=_forward_headers(request),
            content=raw,
        )
        streaming = False
        upstream: httpx.Response | None = None
        try:
            sent, upstream = await unless_disconnected(
                request, unless_stale(client.send(upstream_request, stream=True), admission)
            )
            if not sent:
                metrics.requests.labels("aborted").inc()
                return Response(status_code=499)
            headers = _response_headers(upstream)
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                if adapter.stamp_of(upstream.headers) is not None:
                    refusal = await vouched(upstream.headers, admission)
                    if refusal is not None:
                        await upstream.aclose()
                        return _error(SidecarCode.ENGINE_CHANGED, refusal, ENGINE_RETRY_AFTER_S)
                headers.update(range_headers(start, start if gate.holds_until_done(admission) else None))
                metrics.requests.labels("proxied").inc()
                streaming = True
                events = restamped_stream(
                    upstream,
                    admission,
                    release,
                    lambda: vouched(None, admission),
                    metrics.requests.labels("stale").inc,
                )
                return StampedStream(
                    upstream, release, content=events, status_code=upstream.status_code, headers=headers
                )
            read, content = await unless_disconnected(request, unless_stale(upstream.aread(), admission))
            await upstream.aclose()
            if not read:
                metrics.requests.labels("aborted").inc()
                return Response(status_code=499)
            refusal = await vouched(upstream.headers, admission)
            if refusal is not None:
                return _error(SidecarCode.ENGINE_CHANGED, refusal, ENGINE_RETRY_AFTER_S)
            end = await release()
            headers.update(range_headers(start, end))
            if "json" in upstream.headers.get("content-type", ""):
                content = stamp(content, start, end) or content
            metrics.requests.labels("proxied").inc()
            return Response(content, status_code=upstream.status_code, headers=headers)
        except Stale as stale:  # the upstream request is closed before the swap may proceed
            if upstream is not None:
                await upstream.aclose()
            metrics.requests.labels("stale").inc()
            return _refusal(stale.refused)
        except httpx.TransportError as exc:
            metrics.requests.labels("engine_unavailable").inc()
            return _error(SidecarCode.ENGINE_UNAVAILABLE, f"engine unreachable: {exc}", ENGINE_RETRY_AFTER_S)
        finally:
            if not streaming:
                await release()

    return app
