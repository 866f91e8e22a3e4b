"""The long-poll's fast path: `GET /v1/runs/{run}/head` served without FastAPI's routing,
dependency solving and exception layers.

Every commit wakes every poller, and each poller asks again at once: with a thousand
pollers that is a thousand requests a second on one event loop, and the framework's layers
cost more than the poll itself (py-spy of `bench board --mixed`), which delayed wakes,
commits and downloads alike. This ASGI middleware answers the well-formed,
authorised polls itself, through the same service call, answer bytes and error bodies as
the route (`versions.head`); anything else (a bad name, parameter or token, another
route) goes on to the app, which answers it as before.

Where this process holds the index (the embedded one), a poll does not even become an ASGI
request: `LongPollProtocol`, uvicorn's HTTP protocol, answers it from the head the index
holds, or parks its connection (`ParkedPolls`: no task, no coroutine, a timer for its
wait). A commit's head is encoded once and written to every parked connection from one
callback, which the loop runs after the commit's own answer is written (the head's future
schedules it), so the fan-out never delays the commit that caused it. A parked poll costs
the loop a parse and a dictionary entry, where an ASGI request cost a task, a scope, the
framework's response and several awaits, and it is the re-polls of a thousand pollers
after every commit that kept the loop busy while the next commit waited to be read.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from deltaboard.board.contract.errors import AuthError, BoardError
from deltaboard.board.contract.schemas import MAX_VERSION, RUN_NAME_RE, Head
from deltaboard.board.server.api.errors import error_response
from deltaboard.board.server.api.state import BoardState
from deltaboard.board.server.api.versions import MAX_WAIT_S, encoded, head_json
from deltaboard.board.server.api.zerocopy import ZeroCopyProtocol
from deltaboard.board.server.service import newer

HEAD_PATH = re.compile(r"^/v1/runs/([^/]+)/head$")
ROUTE = "/v1/runs/{run}/head"
# One query parameter of a poll, each value in the shape the route accepts; a query in any
# other spelling (percent-encoded, `+`, an empty pair) is the route's to judge.
PARAMETER = re.compile(rb"after=(-?[0-9]{1,19})|wait=([0-9]{1,6}(?:\.[0-9]{1,9})?)")


def poll_of(scope: Mapping[str, Any]) -> tuple[str, int | None, float] | None:
    """(run, after, wait) of a well-formed head request, None for anything the route
    itself must judge. The query is matched as the bytes it arrived as, a parameter at a
    time: a general parse (`parse_qsl`) was most of this check's cost, paid at every poll."""
    if scope["type"] != "http" or scope["method"] != "GET":
        return None
    matched = HEAD_PATH.fullmatch(scope["path"])
    if matched is None or not RUN_NAME_RE.fullmatch(matched.group(1)):
        return None
    after: int | None = None
    wait: float | None = None
    query: bytes = scope["query_string"]
    for parameter in query.split(b"&") if query else ():
        found = PARAMETER.fullmatch(parameter)
        if found is None:
            return None
        version, seconds = found.groups()
        if version is not None:
            if after is not None or not -1 <= (after := int(version)) <= MAX_VERSION:
                return None
        elif wait is not None or (wait := float(seconds)) > MAX_WAIT_S:
            return None
    return matched.group(1), after, 0.0 if wait is None else wait


def authorised_poll(state: BoardState, scope: Mapping[str, Any]) -> tuple[str, int | None, float] | None:
    """`poll_of`, for a request whose token may read the run; None for anything else (the
    route answers a refused token, with its headers)."""
    poll = poll_of(scope)
    if poll is None:
        return None
    header = dict(scope["headers"]).get(b"authorization")
    try:
        state.auth.check(None if header is None else header.decode("latin-1"), "read", poll[0])
    except AuthError:
        return None
    return poll


class LongPollFastPath:
    def __init__(self, app: ASGIApp, *, state: BoardState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        poll = authorised_poll(self.state, scope)
        if poll is None:
            await self.app(scope, receive, send)
            return
        run, after, wait = poll
        try:
            response = encoded(await self.state.service.wait_for_head(run, after, wait))
        except BoardError as exc:
            response = error_response(exc)
        await response(scope, receive, send)
        self.state.metrics.requests.labels(route=ROUTE, status=str(response.status_code)).inc()


class LongPollProtocol(ZeroCopyProtocol):
    """uvicorn's HTTP protocol, answering the well-formed, authorised long-polls of runs
    whose head this process holds without starting the app (`ParkedPolls`); a request it
    does not take starts the app as before (the hook is uvicorn's `_start_asgi_task`, which
    every request, pipelined ones included, passes through). Pipelining, keep-alive and
    `Connection: close` follow uvicorn's own cycle: a parked poll's cycle stays incomplete
    until its answer is written, so a request pipelined behind it waits for it."""

    polls: ClassVar[ParkedPolls]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.parked: RequestResponseCycle | None = None

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        if app is not self.app or not self.polls.take(self, cycle):
            super()._start_asgi_task(cycle, app)

    def answer(self, answer: HeadAnswer, cycle: RequestResponseCycle) -> None:
        """Write a poll's answer and complete its cycle as uvicorn's `send` would: the
        keep-alive timer, or the next pipelined request, follows."""
        if self.transport.is_closing():
            return
        self.transport.write(answer.kept if cycle.keep_alive else answer.closing)
        if cycle.access_log:
            scope = cycle.scope
            self.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(scope),
                scope["method"],
                get_path_with_query_string(scope),
                scope["http_version"],
                200,
            )
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.polls.forget(self)
        self.parked = None
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The board stops: a parked poll gets the current head at once, and the
        connection closes, as uvicorn closes idle ones."""
        if self.parked is not None:
            self.parked.keep_alive = False
            self.polls.expire(self)
        super().shutdown()


class HeadAnswer:
    """A head's whole HTTP answer, built once for every poll it answers (a commit wakes a
    thousand): the JSON body, the status line and uvicorn's default headers (which it
    renews each second, so an answer is built per wake, not kept)."""

    def __init__(self, head: Head, default_headers: list[tuple[bytes, bytes]]) -> None:
        body = head_json(head)
        lines = [STATUS_LINE[200]]
        lines += [name + b": " + value + b"\r\n" for name, value in default_headers]
        lines.append(b"content-length: %d\r\ncontent-type: application/json\r\n" % len(body))
        self._head = b"".join(lines)
        self._body = body

    @functools.cached_property
    def kept(self) -> bytes:
        """For a connection that stays open."""
        return self._head + b"\r\n" + self._body

    @functools.cached_property
    def closing(self) -> bytes:
        """For a connection that closes after it (`Connection: close`, HTTP/1.0)."""
        return self._head + b"connection: close\r\n\r\n" + self._body


class ParkedPolls:
    """The long-polls `LongPollProtocol` holds, by run, each with the version it has seen
    and a timer for its wait. One callback per run waits on the run's next head
    (`BoardService.next_head`) and answers every poll the head is news to with one
    encoded body; the rest wait on."""

    def __init__(self, state: BoardState) -> None:
        self.state = state
        self._runs: dict[str, dict[LongPollProtocol, int | None]] = {}
        self._timers: dict[LongPollProtocol, tuple[str, asyncio.TimerHandle]] = {}
        self._answered = state.metrics.requests.labels(route=ROUTE, status="200")
        state.metrics.parked = self.__len__

    def __len__(self) -> int:
        """How many polls are parked (the `deltaboard_long_polls` gauge counts them)."""
        return len(self._timers)

    def take(self, protocol: LongPollProtocol, cycle: RequestResponseCycle) -> bool:
        """Answer or park the request if it is a poll this process can answer from its own
        index; False: the app must answer it."""
        poll = authorised_poll(self.state, cycle.scope)
        head = None if poll is None else self.state.service.known_head(poll[0])
        if poll is None or head is None:
            return False
        run, after, wait = poll
        wait = min(wait, self.state.settings.max_wait_s)
        if newer(head, after) or wait <= 0:
            self._answer(protocol, cycle, head)
            return True
        parked = self._runs.get(run)
        if parked is None:
            parked = self._runs[run] = {}
            self.state.service.next_head(run).add_done_callback(functools.partial(self._woken, run))
        parked[protocol] = after
        timer = asyncio.get_running_loop().call_later(wait, self.expire, protocol)
        self._timers[protocol] = (run, timer)
        protocol.parked = cycle
        return True

    def _answer(self, protocol: LongPollProtocol, cycle: RequestResponseCycle | None, head: Head) -> None:
        protocol.parked = None
        if cycle is not None:
            protocol.answer(HeadAnswer(head, protocol.server_state.default_headers), cycle)
            self._answered.inc()

    def forget(self, protocol: LongPollProtocol) -> str | None:
        """Unpark (the connection is gone, or the poll is answered); returns its run."""
        found = self._timers.pop(protocol, None)
        if found is None:
            return None
        run, timer = found
        timer.cancel()
        self._runs.get(run, {}).pop(protocol, None)
        return run

    def expire(self, protocol: LongPollProtocol) -> None:
        """The wait is over: the current head (the index keeps every run's head)."""
        run = self.forget(protocol)
        head = None if run is None else self.state.service.known_head(run)
        if head is not None:
            self._answer(protocol, protocol.parked, head)

    def _woken(self, run: str, future: asyncio.Future[Head]) -> None:
        """Answer every poll of `run` the new head is news to, with one `HeadAnswer`; the
        metrics move once for them all."""
        parked = self._runs.pop(run, {})
        head = future.result()
        waiting = {}
        answer: HeadAnswer | None = None
        answered = 0
        for protocol, after in parked.items():
            if not newer(head, after):
                waiting[protocol] = after
                continue
            found = self._timers.pop(protocol, None)
            if found is None:  # forgotten meanwhile
                continue
            found[1].cancel()
            cycle, protocol.parked = protocol.parked, None
            if cycle is not None:
                if answer is None:
                    answer = HeadAnswer(head, protocol.server_state.default_headers)
                protocol.answer(answer, cycle)
                answered += 1
        self._answered.inc(answered)
        if waiting:  # an epoch's head at their version: wait for the next
            if run in self._runs:  # parked meanwhile (a pipelined poll), already called back
                self._runs[run].update(waiting)
            else:
                self._runs[run] = waiting
                self.state.service.next_head(run).add_done_callback(functools.partial(self._woken, run))


def long_poll_protocol(state: BoardState) -> type[LongPollProtocol]:
    """The protocol class uvicorn builds connections of, with this board's parked polls."""
    return type("BoardProtocol", (LongPollProtocol,), {"polls": ParkedPolls(state)})
