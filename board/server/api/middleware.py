"""ASGI middleware: request metrics; a path with a control character refused (Starlette
anchors its route patterns with `$`, which also matches before a trailing newline, so
`.../assets/config.json%0A` would reach the route of `config.json`); a cap on request
bodies other than blob uploads (which stream to disk and carry their own, larger cap); and
an idle timeout while a body is arriving, so a body shorter than its Content-Length gets a
400 instead of a hung request.

JSON answers are gzipped for clients that accept it (Starlette's `GZipMiddleware` with
`GZIP_*`): a delta's manifest is mostly digests and names and shrinks several-fold, and
small deltas cost as much in manifest as in blobs. Blobs and assets
(`application/octet-stream`: patches are compressed already, and Range answers must stay
byte ranges of the stored object) and event streams are never compressed; blob routes skip
the gzip layer altogether (`BlobsUncompressed`).
"""

from __future__ import annotations

import asyncio
import re

from starlette.middleware.gzip import DEFAULT_EXCLUDED_CONTENT_TYPES, GZipMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaboard.board.contract.errors import BoardError, BodyTooLarge, ErrorCode, InvalidRequest
from deltaboard.board.server.api.errors import RequestBodyError, error_response
from deltaboard.board.server.metrics import BoardMetrics

BLOB_PATH = re.compile(r"^/v1/runs/[^/]+/blobs/[^/]+$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")

GZIP_MIN_BYTES = 1024  # smaller answers (heads, leases) gain less than the work costs
GZIP_LEVEL = 6
GZIP_EXCLUDED = (*DEFAULT_EXCLUDED_CONTENT_TYPES, "application/octet-stream")


class BlobsUncompressed(GZipMiddleware):
    """Starlette's gzip layer, which blob routes skip: a download leaves by
    `http.response.zerocopysend` (`zerocopy`), a message its responder would drop, and
    blobs are never compressed anyway."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and BLOB_PATH.fullmatch(scope["path"]):
            await self.app(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


class BoardMiddleware:
    def __init__(
        self, app: ASGIApp, *, metrics: BoardMetrics, max_body_bytes: int, body_idle_s: float
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.body_idle_s = body_idle_s

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

        # Blob uploads stream to disk under their own cap (`max_blob_bytes`, in the route).
        cap = None if scope["method"] == "PUT" and BLOB_PATH.fullmatch(scope["path"]) else self.max_body_bytes
        refusal = self._refusal(scope, cap)
        if refusal is not None:
            await error_response(refusal)(scope, receive, counting_send)
            self._count(scope, status)
            return
        limited = self._guard(receive, cap)
        try:
            await self.app(scope, limited, counting_send)
        finally:
            self._count(scope, status)

    @staticmethod
    def _refusal(scope: Scope, cap: int | None) -> BoardError | None:
        """Why the request is refused before the app sees it, if it is."""
        if CONTROL.search(scope["path"]):
            return InvalidRequest("the path holds a control character")
        declared = dict(scope["headers"]).get(b"content-length")
        if cap is not None and declared is not None and (not declared.isdigit() or int(declared) > cap):
            return BodyTooLarge(f"bodies are limited to {cap} bytes")
        return None

    def _guard(self, receive: Receive, cap: int | None) -> Receive:
        seen = 0
        complete = False

        async def guarded_receive() -> Message:
            nonlocal seen, complete
            if complete:  # later receives only wait for a disconnect: no timeout
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_idle_s)
            except TimeoutError:
                raise RequestBodyError(
                    InvalidRequest(
                        f"no body bytes for {self.body_idle_s:g}s (shorter than Content-Length?)",
                        code=ErrorCode.INCOMPLETE_BODY,
                    )
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if cap is not None and seen > cap:
                    raise RequestBodyError(BodyTooLarge(f"bodies are limited to {cap} bytes"))
            return message

        return guarded_receive

    def _count(self, scope: Scope, status: int) -> None:
        route = scope.get("route")
        path = getattr(route, "path", "unmatched")
        self.metrics.requests.labels(route=path, status=str(status)).inc()
