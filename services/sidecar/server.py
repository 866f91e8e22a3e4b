"""The sidecar's HTTP/1.1 server protocol: uvicorn's server around a leaner connection.

The sidecar's cost per request is mostly system calls on its sockets (a loopback write
also delivers to the reader, so each costs more than all the Python around it; figures in
docs/design.md). uvicorn's own protocol writes an answer's head and its body in two
writes, checks every header against two regular expressions and carries an access log;
`SidecarProtocol` answers in one write where it can and does no more per request than an
HTTP/1.1 server must. uvicorn still runs everything around it (the listening socket, the
lifespan, the date header, signals and the graceful shutdown): `uvicorn_server` in
`services.sidecar.background` hands it this protocol for the sidecar's app.

What a connection does:

- requests are parsed by httptools; each runs the ASGI app in a task of its own (a
  pipelined request waits for the one before it, reading paused), with the body delivered
  by `receive` as it comes and `http.disconnect` once the client has gone or the answer is
  complete;
- the scope's extension `deltaboard.disconnect` takes a callback that the connection calls
  when its client goes away before the answer is complete: the proxy stops a request's
  work so, without a task per request waiting in `receive` for the disconnect;
- an answer's head is held until its first body part and goes out in the same write; a
  head whose body does not follow before the app's task yields (a stream waiting for its
  first event) is written alone then, so a client is never kept from its headers;
- a body without a `content-length` is sent chunked, one chunk per body part and, with
  its last part, the chunked body's end in the same write;
- a client slower than the answer pauses the app's `send` (write flow control); a body
  bigger than `READ_PAUSE_BYTES` not read yet by the app pauses reading;
- keep-alive connections idle for the server's `timeout_keep_alive` are closed, and a
  graceful shutdown closes idle connections at once and the others after their answer.

What this layer answers itself is JSON as every error of the sidecar is: a request its parser
refuses gets 400 `BadRequest`, an app that fails before its answer starts 500 `Internal`
(after, the connection is closed), each with `connection: close`.
"""

from __future__ import annotations

import asyncio
import functools
import http
import json
import logging
import re
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import httptools

from deltaboard.services.sidecar.constraints import SidecarCode

logger = logging.getLogger("uvicorn.error")
DISCONNECT = "deltaboard.disconnect"
"""The scope extension that takes a callback for the client's going away (`_Cycle.watch`)."""
SINK = "deltaboard.sink"
"""The scope extension that writes body parts from a callback (`_Cycle.write`, `behind`)."""
READ_PAUSE_BYTES = 2**16
# A header's name and value must hold no line break. Not `b"\n" in value`: CPython 3.11's
# `bytes.__contains__` builds a formatted TypeError for every bytes needle before searching.
_CR_OR_LF = re.compile(rb"[\r\n]")
# An origin-form target of printable ASCII without a query or fragment: the path as it is.
_PLAIN_PATH = re.compile(rb"/[\x21\x22\x24-\x3e\x40-\x7e]*")
STATUS_LINE = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in http.HTTPStatus
}
_ASGI = {"version": "3.0", "spec_version": "2.3"}


@functools.cache
def _canned(code: SidecarCode, message: str) -> bytes:
    """A whole answer, as the sidecar's errors are: `{"error": {"code", "message"}}`, with
    the status of the sidecar's one table, and the connection closes after it."""
    from deltaboard.services.sidecar.proxy import HTTP_STATUS  # it imports this module

    body = json.dumps({"error": {"code": str(code), "message": message}}).encode()
    head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return STATUS_LINE[HTTP_STATUS[code]] + head % len(body) + body


BAD_REQUEST = (SidecarCode.BAD_REQUEST, "not an HTTP/1.1 request the sidecar can parse")
INTERNAL = (SidecarCode.INTERNAL, "the sidecar failed to answer this request")


class SidecarProtocol(asyncio.Protocol):
    """One client connection (uvicorn makes one per accepted socket, with `app` bound by
    `uvicorn_server`; `config`, `server_state` and `app_state` are uvicorn's)."""

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        app: Any,
    ) -> None:
        self.app = app
        self.loop = _loop or asyncio.get_event_loop()
        self.state = server_state
        self.app_state = app_state
        self.keep_alive_s: float = config.timeout_keep_alive
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.receiving: _Cycle | None = None  # the request being parsed
        self.running: _Cycle | None = None  # the request being answered
        self.waiting: deque[_Cycle] = deque()  # pipelined requests behind it
        self.idle: asyncio.TimerHandle | None = None
        self.drained: asyncio.Future[None] | None = None  # set while writing is paused
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100 = False

    # the transport's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.state.connections.add(self)
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, without the class
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)
        for cycle in (self.running, self.receiving, *self.waiting):
            if cycle is not None and not cycle.complete:
                cycle.disconnected = True
                cycle.wake()
                if cycle.on_disconnect is not None:
                    cycle.on_disconnect()
        self.waiting.clear()
        self.resume_writing()
        self._stop_idle()

    def data_received(self, data: bytes) -> None:
        self._stop_idle()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no upgrade is served: the request is answered as HTTP/1.1
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(_canned(*BAD_REQUEST))
            self.transport.close()

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.drained is not None:
            if not self.drained.done():
                self.drained.set_result(None)
            self.drained = None

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: an idle connection closes now, a busy one after its answer."""
        assert self.transport is not None
        if self.running is None:
            self.transport.close()
        else:
            self.running.keep_alive = False

    def _stop_idle(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None

    def _close_idle(self) -> None:
        if self.transport is not None and self.running is None:
            self.transport.close()

    # the parser's side (httptools calls these from `feed_data`)

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.expect_100 = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100 = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        version = parser.get_http_version()
        if _PLAIN_PATH.fullmatch(self.url):  # most targets: a path alone, nothing to split
            raw_path, query = self.url, b""
        else:
            url = httptools.parse_url(self.url)
            raw_path, query = url.path, url.query or b""
        path = raw_path.decode("ascii")
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": urllib.parse.unquote(path) if "%" in path else path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": self.headers,
            "state": self.app_state.copy(),
            "extensions": {},
        }
        keep_alive = version != "1.0" and parser.should_keep_alive()
        cycle = _Cycle(self, scope, keep_alive, self.expect_100)
        self.receiving = cycle
        if self.running is None:
            self._run(cycle)
        else:  # pipelined: answered after the request before it
            self.waiting.append(cycle)
            assert self.transport is not None
            self.transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.receiving
        if cycle is None or cycle.complete:
            return
        cycle.body += body
        if len(cycle.body) > READ_PAUSE_BYTES and self.transport is not None:
            self.transport.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.receiving
        if cycle is None or cycle.complete:
            return
        cycle.more_body = False
        cycle.wake()

    # the requests' side

    def _run(self, cycle: _Cycle) -> None:
        self.running = cycle
        task = self.loop.create_task(cycle.run(self.app))
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)

    def answered(self, cycle: _Cycle) -> None:
        """`cycle`'s answer is complete: the next pipelined request runs, or the connection
        waits idle for the next one (closed after `keep_alive_s`)."""
        self.state.total_requests += 1
        if self.running is cycle:
            self.running = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.waiting:
            self._run(self.waiting.popleft())
            if not self.waiting:
                transport.resume_reading()
        else:
            transport.resume_reading()
            self.idle = self.loop.call_later(self.keep_alive_s, self._close_idle)


def _check_headers(headers: Any) -> None:
    """Refuse a header whose name or value holds a line break (it would end the head or
    start a header of its own). One search over them all: a search per name and per value
    was a good part of an answer's head, and almost every head has none."""
    if headers and _CR_OR_LF.search(b"".join([part for header in headers for part in header])):
        for name, value in headers:
            if _CR_OR_LF.search(value) or _CR_OR_LF.search(name):
                raise RuntimeError(f"invalid header {name!r}")


def _chunk(body: bytes) -> bytes:
    """`body` (not empty) as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(body), body)


def _address(value: Any) -> tuple[str, int] | None:
    return (str(value[0]), int(value[1])) if isinstance(value, tuple) and len(value) >= 2 else None


class _Cycle:
    """One request and its answer: the ASGI `receive` and `send` the app is called with."""

    def __init__(
        self, conn: SidecarProtocol, scope: dict[str, Any], keep_alive: bool, expect_100: bool
    ) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_100 = expect_100
        self.head_only = scope["method"] == "HEAD"
        # Set when something happened (a body part, its end, a disconnect); made only for a
        # `receive` that has to wait: most requests arrive whole, before their task's first step.
        self.event: asyncio.Event | None = None
        self.body = bytearray()
        self.more_body = True
        self.delivered = False  # the whole body went to the app
        self.disconnected = False
        self.started = False
        self.complete = False
        self.head: list[bytes] | None = None  # the answer's head, until it is written
        self.chunked = False
        self.left = 0  # bytes of a content-length body still to send
        self.on_disconnect: Callable[[], None] | None = None
        scope["extensions"][DISCONNECT] = self.watch
        scope["extensions"][SINK] = self

    def wake(self) -> None:
        """Wake a `receive` waiting for something to happen, if one is."""
        if self.event is not None:
            self.event.set()

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` if the client goes away before the answer is complete."""
        self.on_disconnect = callback

    async def run(self, app: Any) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except Exception:
            logger.exception("Exception in ASGI application")
            self._fail()
        else:
            if not self.complete and not self.disconnected:
                logger.error("ASGI callable returned without completing its response")
                self._fail()
        finally:
            if not self.complete:  # failed, disconnected or cancelled: the connection is done
                self.complete = True
                if self.conn.transport is not None:
                    self.conn.transport.close()
                self.conn.answered(self)
            # The scope's extensions and the disconnect callback lead back to this cycle
            # (the callback through the request's task): cut here, a request's objects are
            # freed by their reference counts as it ends, instead of accumulating into the
            # garbage collector's passes, which stall the loop for every request.
            self.scope["extensions"].clear()
            self.on_disconnect = None

    def _fail(self) -> None:
        transport = self.conn.transport
        if transport is None:
            return
        if not self.started:
            transport.write(_canned(*INTERNAL))
        transport.close()

    async def receive(self) -> dict[str, Any]:
        transport = self.conn.transport
        if self.expect_100 and transport is not None and not transport.is_closing():
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.expect_100 = False
        while not (self.disconnected or self.complete) and (
            self.delivered or (self.more_body and not self.body)
        ):
            if transport is not None:
                transport.resume_reading()
            if self.event is None:
                self.event = asyncio.Event()
            await self.event.wait()
            self.event.clear()
        if self.disconnected or self.complete or self.delivered:
            return {"type": "http.disconnect"}
        body, more = bytes(self.body), self.more_body
        self.body.clear()
        self.delivered = not more  # all of it: what comes next is the disconnect
        return {"type": "http.request", "body": body, "more_body": more}

    def _ready(self) -> bool:
        """Whether a `receive` now has something for the app: body bytes or the body's end."""
        return not self.delivered and (bool(self.body) or not self.more_body)

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.conn
        if conn.drained is not None and not self.disconnected:
            await asyncio.shield(conn.drained)
        transport = conn.transport
        if self.disconnected or transport is None:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', not {kind!r}")
            self._start(message)
            conn.loop.call_soon(self._flush_head)
            return
        if self.complete or kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        self._body(transport, message.get("body", b""), message.get("more_body", False))

    def write(self, body: bytes) -> None:
        """A part of the answer's body (not its last), written now: what `send` does with
        it, from a callback (the `SINK` extension: the proxy passes an engine's stream so,
        from the upstream connection's reads). Nothing is written once the client is gone."""
        transport = self.conn.transport
        if self.started and not (self.complete or self.disconnected or transport is None):
            if self.chunked and self.head is None and body:  # a stream under way: each read's case
                transport.write(_chunk(body))
            else:
                self._body(transport, body, True)

    def write_framed(self, framed: bytes) -> bool:
        """Parts of the answer's body already framed as whole chunks (none the last),
        written now as they are: `write` without framing them again (the proxy passes an
        engine's chunks so). False, with nothing written, when this answer is not chunked:
        the caller writes the payloads with `write`."""
        if not self.chunked:
            return False
        transport = self.conn.transport
        if not (self.complete or self.disconnected or transport is None):
            head, self.head = self.head, None
            transport.write(framed if head is None else b"".join([*head, framed]))
        return True

    def behind(self) -> asyncio.Future[None] | None:
        """While the client reads slower than it is written to: a future done once it has
        caught up (a `write`r stops writing until then)."""
        return self.conn.drained

    def _body(self, transport: asyncio.Transport, body: bytes, more: bool) -> None:
        out = self.head or []
        self.head = None
        if self.head_only:
            pass
        elif self.chunked:
            if body:
                out.append(_chunk(body))
            if not more:
                out.append(b"0\r\n\r\n")
        else:
            self.left -= len(body)
            if self.left < 0:
                raise RuntimeError("response content longer than its content-length")
            out.append(body)
        if out:
            transport.write(out[0] if len(out) == 1 else b"".join(out))
        if not more:
            if self.left and not self.head_only:
                raise RuntimeError("response content shorter than its content-length")
            self.complete = True
            self.wake()
            if not self.keep_alive:
                transport.close()
            self.conn.answered(self)

    def _start(self, message: dict[str, Any]) -> None:
        headers = message.get("headers", ())
        _check_headers(headers)  # before the answer counts as started: refused, it is a 500
        self.started = True
        self.expect_100 = False
        status = message["status"]
        head = [STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status]
        for name, value in self.conn.state.default_headers:
            head += (name, b": ", value, b"\r\n")
        length: int | None = None
        for name, value in headers:
            lowered = name.lower()
            if lowered == b"content-length":
                length = int(value)
            elif lowered == b"connection" and value.lower().find(b"close") >= 0:
                self.keep_alive = False
                continue
            elif lowered == b"transfer-encoding":
                continue  # the body's framing is this server's: chunked unless a length is given
            head += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        if length is not None:
            self.left = length
        elif not self.head_only and status not in (204, 304) and status >= 200:
            self.chunked = True
            head.append(b"transfer-encoding: chunked\r\n")
        head.append(b"\r\n")
        self.head = head

    def _flush_head(self) -> None:
        """The head alone, when no body part came with it in the same step of the app."""
        if self.head is not None and not self.disconnected and self.conn.transport is not None:
            self.conn.transport.write(b"".join(self.head))
            self.head = None
