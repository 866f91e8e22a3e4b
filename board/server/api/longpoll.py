"""The long-poll's fast path: `GET /v1/runs/{run}/head` served without FastAPI's routing,
dependency solving and exception layers.

Every commit wakes every poller, and each poller asks again at once: with a thousand
pollers that is a thousand requests a second on one event loop, and the framework's layers
cost more than the poll itself (py-spy of `bench board --mixed`), which delayed wakes,
commits and downloads alike. This ASGI middleware answers the well-formed,
authorised polls itself, through the same service call, answer bytes and error bodies as
the route (`versions.head`); anything else (a bad name, parameter or token, another
route) goes on to the app, which answers it as before.
"""

from __future__ import annotations

import math
import re
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from deltaboard.board.contract.errors import AuthError, BoardError
from deltaboard.board.contract.schemas import MAX_VERSION, RUN_NAME_RE
from deltaboard.board.server.api.errors import error_response
from deltaboard.board.server.api.state import BoardState
from deltaboard.board.server.api.versions import MAX_WAIT_S, encoded

HEAD_PATH = re.compile(r"^/v1/runs/([^/]+)/head$")
ROUTE = "/v1/runs/{run}/head"
INTEGER = re.compile(r"^-?[0-9]{1,19}$")
DECIMAL = re.compile(r"^[0-9]{1,6}(\.[0-9]{1,9})?$")


def poll_of(scope: Scope) -> tuple[str, int | None, float] | None:
    """(run, after, wait) of a well-formed head request, None for anything the route
    itself must judge."""
    if scope["type"] != "http" or scope["method"] != "GET":
        return None
    matched = HEAD_PATH.fullmatch(scope["path"])
    if matched is None or not RUN_NAME_RE.fullmatch(matched.group(1)):
        return None
    params: dict[str, str] = {}
    for key, value in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True):
        if key not in ("after", "wait") or key in params:
            return None
        params[key] = value
    after: int | None = None
    if "after" in params:
        if not INTEGER.fullmatch(params["after"]) or not -1 <= int(params["after"]) <= MAX_VERSION:
            return None
        after = int(params["after"])
    wait = 0.0
    if "wait" in params:
        if not DECIMAL.fullmatch(params["wait"]):
            return None
        wait = float(params["wait"])
        if not (math.isfinite(wait) and wait <= MAX_WAIT_S):
            return None
    return matched.group(1), after, wait


class LongPollFastPath:
    def __init__(self, app: ASGIApp, *, state: BoardState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        poll = poll_of(scope)
        if poll is not None:
            run, after, wait = poll
            header = dict(scope["headers"]).get(b"authorization")
            authorization = None if header is None else header.decode("latin-1")
            try:
                self.state.auth.check(authorization, "read", run)
            except AuthError:
                poll = None  # the route answers it, with its headers
        if poll is None:
            await self.app(scope, receive, send)
            return
        try:
            response = encoded(await self.state.service.wait_for_head(run, after, wait))
        except BoardError as exc:
            response = error_response(exc)
        await response(scope, receive, send)
        self.state.metrics.requests.labels(route=ROUTE, status=str(response.status_code)).inc()
