"""The board's error vocabulary, shared by the server (which raises it) and the client
(which rebuilds it from the JSON body), so both sides name failures the same way."""

from __future__ import annotations

from typing import Any


class BoardError(Exception):
    """A failure with a stable `code` (e.g. `NotHead`), an HTTP status and optional details.

    Callers branch on `code`, never on the message text.
    """

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.extra = extra

    def body(self) -> dict[str, Any]:
        """The JSON error body of the contract: `{"error": {"code", "message", ...}}`."""
        return {"error": {"code": self.code, "message": self.message, **self.extra}}


def not_found(code: str, message: str, **extra: Any) -> BoardError:
    return BoardError(404, code, message, **extra)


def conflict(code: str, message: str, **extra: Any) -> BoardError:
    return BoardError(409, code, message, **extra)


def bad_request(code: str, message: str, **extra: Any) -> BoardError:
    return BoardError(400, code, message, **extra)


def unprocessable(code: str, message: str, **extra: Any) -> BoardError:
    return BoardError(422, code, message, **extra)
