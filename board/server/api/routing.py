"""The board's route class, and what the routes declare alike in the OpenAPI schema.

Request bodies are parsed as strict JSON (pydantic's parser, not the standard library's,
which reads lone surrogates such as `"\\ud800"` and invalid UTF-8 into strings that no
answer can encode afterwards): such a body is refused with 400 `MalformedJSON` before any
route sees it. Non-finite numbers (`NaN`, `1e999`) parse, and the schemas refuse them
with 422 naming the field (`board.contract.schemas`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic_core import from_json

from deltaboard.board.contract.errors import ErrorCode, InvalidRequest
from deltaboard.board.server.api.errors import RequestBodyError, documented

# Error statuses of every route on a run: a bad run name, no or a weak token, no such
# run, a parameter outside its schema, the store or the index out of reach. (422 is
# declared on every route with parameters, or FastAPI would declare its own body for it.)
RUN_ERRORS = (400, 401, 403, 404, 422, 503)
# ... and of a route with a body: too large for the board.
INPUT_ERRORS = (413,)

BINARY: dict[str, Any] = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
# What a route that stores raw bytes (assets, blobs) declares.
RAW_UPLOAD: dict[str, Any] = {
    "status_code": 201,
    "responses": documented(*RUN_ERRORS, *INPUT_ERRORS),
    "openapi_extra": {"requestBody": {"required": True, "content": BINARY}},
}


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = from_json(await self.body(), allow_inf_nan=True)
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
