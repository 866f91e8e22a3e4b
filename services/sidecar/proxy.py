"""The sidecar's HTTP app: version-checked proxying of every route to the engine.

Each request goes through `VersionGate.admit` (served / wait / 409 / 410), is forwarded
with its `weight_version` removed, and comes back with the version range it was served
with:

- headers `X-Weight-Version-Start` and `X-Weight-Version-End` (a stream's headers carry
  the end only when the gate holds its version until the request is done: `quiesce`
  mode, or a request pinned at the served version; otherwise the last event says),
- a JSON object body gains `"weight_version": {"start": s, "end": e}`,
- a stream's last data event (the one before `data: [DONE]`) gains the same field.

A client that disconnects cancels the upstream request (the engine sees the
disconnect and stops generating); an engine that cannot be reached gives 503 with
`Retry-After`. The sidecar's own routes are `/healthz`, `/metrics` and `/sidecar/status`.
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

from deltaboard.services.sidecar.background import unless_disconnected
from deltaboard.services.sidecar.constraints import (
    HEADER_PREFIX,
    ConstraintError,
    SidecarCode,
    parse_constraint,
)
from deltaboard.services.sidecar.gate import Admitted, Refused, VersionGate
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
RESPONSE_DROP = HOP_BY_HOP | {"content-encoding"}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
ENGINE_RETRY_AFTER_S = 2

# The sidecar's one table from error code to HTTP status, and to the requests metric's label.
HTTP_STATUS: dict[SidecarCode, int] = {
    SidecarCode.BAD_WEIGHT_VERSION: 400,
    SidecarCode.WEIGHT_VERSION_NOT_READY: 409,
    SidecarCode.WEIGHT_VERSION_GONE: 410,
    SidecarCode.BODY_TOO_LARGE: 413,
    SidecarCode.ENGINE_UNAVAILABLE: 503,
}
OUTCOME: dict[SidecarCode, str] = {
    SidecarCode.WEIGHT_VERSION_NOT_READY: "not_ready",
    SidecarCode.WEIGHT_VERSION_GONE: "gone",
    SidecarCode.ENGINE_UNAVAILABLE: "unavailable",
}


@dataclass(frozen=True)
class ProxySettings:
    engine_url: str
    default_wait_s: float = 30.0
    max_wait_s: float = 300.0
    engine_timeout_s: float = 600.0
    max_body_bytes: int = 64 * 2**20  # prompts, not uploads: a bigger body is refused (413)


def _error(code: SidecarCode, message: str, retry_after: int | None = None, **extra: Any) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"code": str(code), "message": message, **extra}}
    return JSONResponse(body, status_code=HTTP_STATUS[code], headers=headers)


def _refusal(refused: Refused) -> JSONResponse:
    return _error(
        refused.code,
        refused.message,
        refused.retry_after_s,
        served=refused.served,
        required=refused.required,
        head=refused.head,
        retryable=refused.code != SidecarCode.WEIGHT_VERSION_GONE,
    )


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

    @app.api_route("/{path:path}", methods=METHODS)
    async def proxy(path: str, request: Request) -> Response:
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
        release = Release(gate, admission.high)
        upstream_request = client.build_request(
            request.method,
            "/" + path,
            params=list(request.query_params.multi_items()),
            headers=_forward_headers(request),
            content=raw,
        )
        streaming = False
        try:
            sent, upstream = await unless_disconnected(request, client.send(upstream_request, stream=True))
            if not sent:
                metrics.requests.labels("aborted").inc()
                return Response(status_code=499)
            headers = _response_headers(upstream)
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                headers.update(range_headers(start, start if gate.holds_until_done(admission) else None))
                metrics.requests.labels("proxied").inc()
                streaming = True
                return StampedStream(
                    upstream,
                    release,
                    content=restamped_stream(upstream, start, release),
                    status_code=upstream.status_code,
                    headers=headers,
                )
            read, content = await unless_disconnected(request, upstream.aread())
            await upstream.aclose()
            if not read:
                metrics.requests.labels("aborted").inc()
                return Response(status_code=499)
            end = await release()
            headers.update(range_headers(start, end))
            if "json" in upstream.headers.get("content-type", ""):
                content = stamp(content, start, end) or content
            metrics.requests.labels("proxied").inc()
            return Response(content, status_code=upstream.status_code, headers=headers)
        except httpx.TransportError as exc:
            metrics.requests.labels("engine_unavailable").inc()
            return _error(SidecarCode.ENGINE_UNAVAILABLE, f"engine unreachable: {exc}", ENGINE_RETRY_AFTER_S)
        finally:
            if not streaming:
                await release()

    return app
