"""ASGI middleware: request metrics, and a cap on request bodies other than blob uploads
(which stream to disk and carry their own, larger cap)."""

from __future__ import annotations

import re

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from board.api.errors import error_response
from board.metrics import BoardMetrics

BLOB_PUT = re.compile(r"^/v1/runs/[^/]+/blobs/[^/]+$")


class BoardMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: BoardMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        limited = receive
        if not (scope["method"] == "PUT" and BLOB_PUT.match(scope["path"])):
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
                response = error_response(
                    413, "BodyTooLarge", f"bodies are limited to {self.max_body_bytes} bytes"
                )
                await response(scope, receive, counting_send)
                self._count(scope, status)
                return
            limited = self._limit(receive)
        try:
            await self.app(scope, limited, counting_send)
        finally:
            self._count(scope, status)

    def _limit(self, receive: Receive) -> Receive:
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, f"bodies are limited to {self.max_body_bytes} bytes")
            return message

        return limited_receive

    def _count(self, scope: Scope, status: int) -> None:
        route = scope.get("route")
        path = getattr(route, "path", "unmatched")
        self.metrics.requests.labels(route=path, status=str(status)).inc()
