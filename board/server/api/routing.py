"""The board's route class, and what the routes declare alike in the OpenAPI schema.

Request bodies are parsed as strict JSON (pydantic's parser, not the standard library's,
which reads lone surrogates such as `"\\ud800"` and invalid UTF-8 into strings that no
answer can encode afterwards): such a body is refused with 400 `MalformedJSON` before any
route sees it. Non-finite numbers (`NaN`, `1e999`) parse, and the schemas refuse them
with 422 naming the field (`board.contract.schemas`).

A JSON body may come compressed, `Content-Encoding: zstd` (a publisher's commit of a
model of many tensors: a manifest of 20,000 entries is 2.2 MB of JSON and ~95 KB of zstd,
and crosses the trainer's link at every version). It is decoded before parsing, to at
most the board's body limit (413 `BodyTooLarge` beyond it, whatever the frame declares);
a body that is not one whole frame is 400 `BadRequest`, any other encoding 415
`UnsupportedEncoding`. Raw uploads (blobs, assets) are stored as sent, never decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import zstandard
from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic_core import from_json

from deltaboard.board.contract.errors import BodyTooLarge, ErrorCode, InvalidRequest
from deltaboard.board.server.api.errors import RequestBodyError, documented

# Error statuses of every route on a run: a bad run name, no or a weak token, no such
# run, a parameter outside its schema, the store or the index out of reach. (422 is
# declared on every route with parameters, or FastAPI would declare its own body for it.)
RUN_ERRORS = (400, 401, 403, 404, 422, 503)
# ... and of a route with a body: too large for the board, or in an encoding it does not read.
INPUT_ERRORS = (413, 415)

BINARY: dict[str, Any] = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
# What a route that stores raw bytes (assets, blobs) declares.
RAW_UPLOAD: dict[str, Any] = {
    "status_code": 201,
    "responses": documented(*RUN_ERRORS, *INPUT_ERRORS),
    "openapi_extra": {"requestBody": {"required": True, "content": BINARY}},
}


def decoded_body(body: bytes, encoding: str | None, cap: int) -> bytes:
    """`body` as sent with `Content-Encoding: encoding` (None: none), decoded to at most
    `cap` bytes (see the module's docstring)."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding != "zstd":
        message = f"Content-Encoding {encoding!r}: a JSON body is read as sent or as zstd"
        raise RequestBodyError(InvalidRequest(message, code=ErrorCode.UNSUPPORTED_ENCODING))
    try:
        declared = zstandard.get_frame_parameters(body).content_size
        if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > cap:
            raise RequestBodyError(BodyTooLarge(f"bodies are limited to {cap} bytes, decoded"))
        # a declared size is what the frame must decode to; else at most the limit
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=cap)
    except zstandard.ZstdError as e:
        message = f"the body is not one whole zstd frame of at most {cap} bytes: {e}"
        raise RequestBodyError(InvalidRequest(message)) from None


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            cap = self.app.state.board.settings.max_body_bytes
            body = decoded_body(await self.body(), self.headers.get("content-encoding"), cap)
            try:
                self._json = from_json(body, allow_inf_nan=True)
            except ValueError as e:
                error = InvalidRequest(f"the body is not valid JSON: {e}", code=ErrorCode.MALFORMED_JSON)
                raise RequestBodyError(error) from None
        return self._json


class BoardRoute(APIRoute):
    """A route whose handler reads the request as a `StrictJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict
