"""Every failure leaves the board as JSON `{"error": {"code", "message", ...}}` with the
right status; a client mistake never turns into a 500."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from deltaboard.board.contract.errors import BoardError

log = logging.getLogger("deltaboard.board")

STATUS_CODES = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    411: "LengthRequired",
    413: "BodyTooLarge",
    416: "RangeNotSatisfiable",
}


class RequestBodyError(HTTPException):
    """Raised while a request body is being received (too large, stalled): an
    HTTPException, so that FastAPI's body parsing passes it through unchanged."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(status, message)
        self.code = code


def error_response(status: int, code: str, message: str, **extra: Any) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        BoardError(status, code, message, **extra).body(), status_code=status, headers=headers
    )


async def _board_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BoardError)
    return error_response(exc.status, exc.code, exc.message, **exc.extra)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors()
    ]
    if any(e["type"] == "json_invalid" for e in errors):
        return error_response(400, "MalformedJSON", "the body is not valid JSON", details=errors)
    return error_response(422, "ValidationError", "the request does not match the schema", details=errors)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = exc.code if isinstance(exc, RequestBodyError) else STATUS_CODES.get(exc.status_code, "HTTPError")
    return error_response(exc.status_code, code, str(exc.detail))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "Internal", "internal error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(BoardError, _board_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
