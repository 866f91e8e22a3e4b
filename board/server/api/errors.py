"""Every failure leaves the board as JSON `{"error": {"code", "message", ...}}` with the
right status; a client mistake never turns into a 500.

This is the one place that knows HTTP statuses: `HTTP_STATUS` maps each error code of
the contract (`board.contract.errors.ErrorCode`) to its status, `error_response` builds
every error body the board sends, and `documented` declares them in the OpenAPI schema.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from deltaboard.board.contract.errors import (
    BoardError,
    BoardUnavailable,
    ErrorCode,
    InvalidRequest,
    error_class,
)
from deltaboard.board.contract.schemas import ErrorBody

log = logging.getLogger("deltaboard.board")

C = ErrorCode

# The status of each code. `HTTPError` has none of its own: it names an unusual status
# that the framework chose (`_http_error`).
HTTP_STATUS: dict[ErrorCode, int] = {
    C.BAD_REQUEST: 400,
    C.MALFORMED_JSON: 400,
    C.BAD_RUN_NAME: 400,
    C.BAD_ASSET_NAME: 400,
    C.BAD_DIGEST: 400,
    C.BAD_RANGE: 400,
    C.INCOMPLETE_BODY: 400,
    C.DIGEST_MISMATCH: 400,
    C.UNAUTHORIZED: 401,
    C.FORBIDDEN: 403,
    C.NOT_FOUND: 404,
    C.UNKNOWN_RUN: 404,
    C.UNKNOWN_ASSET: 404,
    C.UNKNOWN_BLOB: 404,
    C.UNKNOWN_VERSION: 404,
    C.UNKNOWN_BASE: 404,
    C.NO_VERSIONS: 404,
    C.NO_CHAIN: 404,
    C.UNKNOWN_PREPARED: 404,
    C.METHOD_NOT_ALLOWED: 405,
    C.NOT_HEAD: 409,
    C.STALE_EPOCH: 409,
    C.NO_LEASE: 409,
    C.LEASE_HELD: 409,
    C.CONTENDED: 409,
    C.LENGTH_REQUIRED: 411,
    C.BODY_TOO_LARGE: 413,
    C.UNSUPPORTED_ENCODING: 415,
    C.RANGE_NOT_SATISFIABLE: 416,
    C.VALIDATION_ERROR: 422,
    C.BAD_MANIFEST: 422,
    C.MISSING_BLOBS: 422,
    C.INTERNAL: 500,
    C.STORE_UNAVAILABLE: 503,
    C.INDEX_UNAVAILABLE: 503,
}

# The code of a bare status raised by the framework (routing, Starlette's own checks).
FRAMEWORK_CODES: dict[int, ErrorCode] = {
    HTTP_STATUS[code]: code
    for code in (
        C.BAD_REQUEST,
        C.UNAUTHORIZED,
        C.FORBIDDEN,
        C.NOT_FOUND,
        C.METHOD_NOT_ALLOWED,
        C.LENGTH_REQUIRED,
        C.BODY_TOO_LARGE,
        C.RANGE_NOT_SATISFIABLE,
    )
}


def status_of(error: BoardError) -> int:
    """The HTTP status of `error` (500 for a code outside the table: a board bug)."""
    try:
        return HTTP_STATUS[ErrorCode(error.code)]
    except (ValueError, KeyError):
        return 500


class RequestBodyError(HTTPException):
    """Raised while a request body is being received (too large, stalled): an
    HTTPException, so that FastAPI's body parsing passes it through unchanged."""

    def __init__(self, error: BoardError) -> None:
        super().__init__(status_of(error), error.message)
        self.error = error


# Seconds a client should wait before retrying a 503 (the board's store or index is out
# of reach; the client's own backoff also applies).
RETRY_AFTER_S = 2


def error_response(
    error: BoardError, status: int | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The JSON answer for `error`, with its status from the table unless `status` is given,
    and the headers its status calls for (`WWW-Authenticate` on 401, `Retry-After` on 503)
    besides `headers` (e.g. `Allow` on a 405)."""
    status = status_of(error) if status is None else status
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return JSONResponse(error.body(), status_code=status, headers=headers)


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route's error statuses: each with the error body's
    schema and the codes it carries."""
    return {
        status: {
            "model": ErrorBody,
            "description": ", ".join(code for code, s in HTTP_STATUS.items() if s == status) or "error",
        }
        for status in statuses
    }


async def _board_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BoardError)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors()
    ]
    if any(e["type"] == "json_invalid" for e in errors):
        return error_response(
            InvalidRequest("the body is not valid JSON", code=C.MALFORMED_JSON, details=errors)
        )
    return error_response(
        InvalidRequest("the request does not match the schema", code=C.VALIDATION_ERROR, details=errors)
    )


def _http_error(routes: Sequence[BaseRoute]) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        if isinstance(exc, RequestBodyError):
            return error_response(exc.error)
        code = FRAMEWORK_CODES.get(exc.status_code, C.HTTP_ERROR)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed(routes, request.scope)
        return error_response(error_class(code)(str(exc.detail), code=code), exc.status_code, headers)

    return handler


def _allowed(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """Every method some route takes on this path (the router names only the first
    matching route's, and a path may have several: GET and POST .../fleet)."""
    methods: set[str] = set()
    for route in routes:
        if route.matches(scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(BoardUnavailable("internal error"))


def install_error_handlers(app: FastAPI, routes: Sequence[BaseRoute]) -> None:
    """Answer every failure with the board's JSON; `routes` (every route of the app) name
    the methods a 405 allows."""
    app.add_exception_handler(BoardError, _board_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error(routes))
    app.add_exception_handler(Exception, _unexpected)
