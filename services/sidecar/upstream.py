"""The sidecar's HTTP/1.1 client to its one engine: a pool of raw asyncio connections.

Every rollout request passes through the sidecar, so its client must cost next to nothing
per request and never make requests queue for a connection. Measured against the engine
stand-in of `services.bench.sidecar_bench` (figures in docs/design.md), httpx's pool
(httpcore) handed one idle connection to every waiting request and made the losers retry,
polled every pooled socket for expiry, and read a stream one HTTP chunk (one token) at a
time; this client does none of that:

- a request takes an idle connection or opens a new one at once: no limit and no queue
  (the engine, not the sidecar, decides how many requests it serves at a time); idle
  connections are kept up to `max_idle`, and one the engine closed while idle is skipped,
  or, when it closes under the request before a byte of the answer came, the request is
  sent once more on a new connection;
- the request goes out in one write, the response head is parsed once into a
  `ResponseHeaders` (case-insensitive, what the engine adapters read stamps from);
- a chunked body is decoded from whatever one socket read brings: every complete chunk in
  it is passed on as one piece, so a stream the sidecar reads behind the engine costs one
  pass per read, not per token.
- `UpstreamResponse.forward` hands a chunked body's reads to a callback from the
  connection's own `data_received` (the connection's protocol is swapped for the time),
  so a stream passed to the client costs no coroutine step per read; reading pauses while
  the client lags behind what the callback wrote. A read of whole chunks, each ending as
  the caller says (a stream's events: `\n\n`; `whole_chunks`), can go to another
  callback as it came, framing and all, not decoded: the client's answer is chunked too,
  and such a read is passed on in one write, with no step per chunk.

A response's connection goes back to the pool only once its body was read to the end;
`aclose` before that closes the connection, which is how the engine learns that nobody
reads the request any more (it stops generating). Failures to reach the engine or to get
a whole answer raise `UpstreamError`, and so does an answer not framed as HTTP/1.1 says (a
chunk size that is not hex digits, a chunk without its CRLF, a content-length that is not
digits): its connection is closed, not pooled. Reads have no timeout of their own: the caller
bounds a request as a whole (the proxy's `Deadline`), and cancelling it closes its connection.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

READ_SIZE = 2**16
CONNECT_TIMEOUT_S = 5.0
MAX_STARTS = 1024  # request lines with their host header, made once and kept (`UpstreamPool.request`)
MAX_SIZE_LINE = 4096  # a chunk's size line and its extensions; longer is not an engine's
_HEX = b"0123456789abcdefABCDEF"
_CR, _LF = b"\r\n"


class UpstreamError(OSError):
    """The engine could not be reached, or closed the connection before a whole answer."""


class ResponseHeaders(dict[str, str]):
    """A response's headers by lower-case name (`get` takes any case), in arrival order in
    `raw` (bytes, names lower-cased; made when first read: an answer the sidecar reads
    itself, such as the engine's stamp, passes none of its headers on)."""

    __slots__ = ("_pairs", "_raw")

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        super().__init__(pairs)
        self._pairs = pairs
        self._raw: list[tuple[bytes, bytes]] | None = None

    @property
    def raw(self) -> list[tuple[bytes, bytes]]:
        # not `functools.cached_property`: its lock costs more than the encoding
        if self._raw is None:
            self._raw = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self._pairs]
        return self._raw

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


# `ResponseHeaders.get` without its lower-casing, for the names this module reads (lower case)
_get = dict.get


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.transport.abort()  # at once: the engine sees the request go away


class UpstreamResponse:
    """A response whose body is read by `aread` or `aiter_raw` (decoded from chunked
    transfer encoding, not from any content encoding: the sidecar passes bodies as they are)."""

    def __init__(
        self,
        pool: UpstreamPool,
        conn: _Connection,
        status_code: int,
        headers: ResponseHeaders,
        keep: bool,
        bodyless: bool,
    ) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status_code = status_code
        self.headers = headers
        self._keep = keep
        self.ended = False  # the last piece of the body was handed out
        length = _get(headers, "content-length")
        self.chunked = "chunked" in _get(headers, "transfer-encoding", "").lower()
        self._chunks = _Chunks()  # a chunked body's decoder, shared by `forward` and `aiter_raw`
        self._length = None
        if length is not None and not self.chunked:
            if not (length.isascii() and length.isdigit()):  # `int` takes signs and spaces
                raise UpstreamError(f"the engine's content-length is not one: {length[:80]!r}")
            self._length = int(length)
        if bodyless or status_code in (204, 304) or 100 <= status_code < 200:
            self._length = 0

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives: one piece per read of the connection."""
        conn = self._conn
        if conn is None:
            return
        reader = conn.reader
        try:
            if self.chunked:
                chunks = self._chunks
                while not chunks.done:
                    payload = chunks.feed(await reader.read(READ_SIZE))
                    if payload:
                        self.ended = chunks.done
                        yield payload
            elif self._length is not None:
                left = self._length
                while left:
                    part = await reader.read(min(left, READ_SIZE))
                    if not part:
                        raise UpstreamError(f"the engine closed the connection {left} bytes before the end")
                    left -= len(part)
                    self.ended = not left
                    yield part
            else:  # delimited by the connection's end
                self._keep = False
                while part := await reader.read(READ_SIZE):
                    yield part
        except UpstreamError:
            await self.aclose()
            raise
        except (OSError, ValueError) as exc:
            await self.aclose()
            raise UpstreamError(f"reading the engine's answer: {exc!r}") from exc
        self._conn = None
        if self._keep:
            self._pool.put(conn)
        else:
            conn.close()

    async def aread(self) -> bytes:
        return b"".join([part async for part in self.aiter_raw()])

    async def forward(
        self,
        on_data: Callable[[bytes], bool],
        backpressure: Callable[[], asyncio.Future[None] | None],
        framed: Framed | None = None,
    ) -> None:
        """Hand each read of a chunked body, decoded, to `on_data` from the connection's
        own `data_received`, as it arrives: no coroutine step, future or generator per
        read. Returns once `on_data` returns False or the body has ended; the rest (if any)
        is read by `aiter_raw`. While `backpressure()` gives a future (the reader of what
        `on_data` writes is behind), the connection is not read until it is done.

        With `framed` (`Framed`), a read of whole chunks as `framed.reads` says goes to
        `framed.on_read` as it came, chunk framing and all; only when that declines it
        (None) is it decoded for `on_data`."""
        conn = self._conn
        if conn is None or not self.chunked or self._chunks.done:
            return
        forward_one = self._forward_one if framed is None else functools.partial(self._forward_framed, framed)
        try:
            if not forward_one(on_data, await conn.reader.read(1 << 30)):  # all it holds
                return
        except UpstreamError:
            await self.aclose()
            raise
        transport = conn.writer.transport
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reader = transport.get_protocol()
        transport.set_protocol(_Forward(forward_one, reader, on_data, backpressure, transport, done))
        try:
            await done
        except UpstreamError:
            await self.aclose()
            raise
        finally:
            if not transport.is_closing():
                transport.set_protocol(reader)

    def _forward_one(self, on_data: Callable[[bytes], bool], data: bytes) -> bool:
        """Whether to go on after handing `data`'s payload to `on_data`."""
        chunks = self._chunks
        payload = chunks.feed(data)
        self.ended = chunks.done
        if payload and not on_data(payload):
            return False
        return not chunks.done

    def _forward_framed(self, framed: Framed, on_data: Callable[[bytes], bool], data: bytes) -> bool:
        """`_forward_one`, but `data` goes to `framed.on_read` as it came where it is whole
        chunks as `framed.reads` says (which leaves the decoder as it was: between chunks)."""
        if not self._chunks.held() and framed.reads.fullmatch(data) is not None:
            go_on = framed.on_read(data)
            if go_on is not None:
                return go_on
        return self._forward_one(on_data, data)

    async def aclose(self) -> None:
        """Give up the rest of the body: the connection is closed (not pooled)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _Forward(asyncio.Protocol):
    """The connection's protocol while `UpstreamResponse.forward` runs: reads go to the
    forwarder, and back to the connection's reader (`reader`) once it is done."""

    def __init__(
        self,
        forward_one: Callable[[Callable[[bytes], bool], bytes], bool],
        reader: Any,
        on_data: Callable[[bytes], bool],
        backpressure: Callable[[], asyncio.Future[None] | None],
        transport: Any,
        done: asyncio.Future[None],
    ) -> None:
        self.forward_one = forward_one
        self.reader = reader
        self.on_data = on_data
        self.backpressure = backpressure
        self.transport = transport
        self.done = done

    def data_received(self, data: bytes) -> None:
        if self.done.done():  # between the end and the reader's return: the reader's
            self.reader.data_received(data)
            return
        try:
            go_on = self.forward_one(self.on_data, data)
        except (UpstreamError, ValueError) as exc:
            self.done.set_exception(UpstreamError(f"reading the engine's answer: {exc!r}"))
            return
        if not go_on:
            self.done.set_result(None)
            return
        behind = self.backpressure()
        if behind is not None:
            self.transport.pause_reading()
            behind.add_done_callback(self._resume)

    def _resume(self, _: object) -> None:
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def eof_received(self) -> bool | None:
        self._lost()
        return self.reader.eof_received()  # type: ignore[no-any-return]

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()
        self.reader.connection_lost(exc)

    def _lost(self) -> None:
        if not self.done.done():
            self.done.set_exception(UpstreamError("the engine closed the connection inside a chunked body"))

    def pause_writing(self) -> None:
        self.reader.pause_writing()

    def resume_writing(self) -> None:
        self.reader.resume_writing()


class _Chunks:
    """Decodes a chunked body from the reads of its connection, as they come."""

    def __init__(self) -> None:
        self._buf = b""
        self.done = False

    def held(self) -> bool:
        """Whether a chunk is under way: the start of one came and the rest did not yet."""
        return bool(self._buf)

    def feed(self, data: bytes) -> bytes:
        """The payload of every chunk that `data` completes, joined (b"": none yet). A fast
        engine's read holds many chunks (a token each), so this loop is the sidecar's
        per-token work: a find and a slice per chunk, and two checks of a few bytes (no
        find past a read that ends with a chunk, as an engine's writes do). Framing that is
        not chunked encoding raises `UpstreamError`: a size line that is not hex digits
        (say a negative size, which sent this loop backwards for ever) or a payload not
        followed by CRLF."""
        if not data:
            raise UpstreamError("the engine closed the connection inside a chunked body")
        buf = self._buf + data if self._buf else data
        parts = []
        pos = 0
        length = len(buf)
        stop = length - 2
        while pos < length:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:  # a size line under way
                if length - pos > MAX_SIZE_LINE:
                    raise UpstreamError(f"the engine's chunk size line runs on: {buf[pos : pos + 80]!r}")
                break
            line = buf[pos:eol]
            size = _chunk_size(line) if line.strip(_HEX) or not line else int(line, 16)
            if size == 0:
                self.done = buf.find(b"\r\n\r\n", eol) >= 0  # the end, past any trailers
                break
            end = eol + 2 + size
            if end > stop:
                break
            if buf[end] != _CR or buf[end + 1] != _LF:
                raise UpstreamError(f"the engine's chunk of {size} bytes is not followed by CRLF")
            parts.append(buf[eol + 2 : end])
            pos = end + 2
        self._buf = buf[pos:] if pos < length else b""
        return parts[0] if len(parts) == 1 else b"".join(parts)


def whole_chunks(ending: bytes) -> re.Pattern[bytes]:
    """A pattern that a read matches (`fullmatch`) when it is whole chunks, each a size in
    hex alone on its line and a payload that holds no CR and ends with `ending` (not
    empty: the body's last chunk, size 0, is not one of them). Such a read, from the start
    of a chunk, ends at the end of one: in a payload without CR the first CRLF after it is
    the framing's. The sizes are not checked against the payloads (a check per chunk in
    Python costs what decoding them does): a read that matches goes on as it came, framed
    as the engine framed it, and the one read that could match while ending inside a chunk
    is of an engine whose payload holds, after a line ended by LF, a CRLF and a line of
    hex digits alone, which no server-sent event stream an engine writes does."""
    return re.compile(rb"(?:[0-9a-fA-F]+\r\n[^\r]*" + re.escape(ending) + rb"\r\n)+")


@dataclass(frozen=True)
class Framed:
    """How `UpstreamResponse.forward` may pass reads on as they came: `on_read` takes a
    read that `reads` matches (`whole_chunks`) as it came, framing and all, and says
    whether to go on, or None when it does not take it (it is then decoded for `on_data`)."""

    reads: re.Pattern[bytes]
    on_read: Callable[[bytes], bool | None]


def _chunk_size(line: bytes) -> int:
    """A chunk's size from a size line that is not hex digits alone: hex digits, then `;`
    extensions (after optional white space, as RFC 9112 allows). Anything else (a sign, a
    `0x`, an empty line) is not chunked framing: `UpstreamError`, as `int` would take some."""
    size, extensions, _ = line.partition(b";")
    size = size.rstrip(b" \t")
    if not extensions or not size or size.strip(_HEX):
        raise UpstreamError(f"the engine's chunk size line is not one: {line[:80]!r}")
    return int(size, 16)


class UpstreamPool:
    """Connections to the engine at `url` (http only: it sits beside the sidecar)."""

    def __init__(self, url: str, max_idle: int = 512) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"the engine's URL must be http://host:port, not {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        # A request's line and host header, by (method, target): the few targets a
        # sidecar passes are made once (a query string makes one of its own; bounded).
        self._starts: dict[tuple[str, str], bytes] = {}
        self._idle: deque[_Connection] = deque()
        self._max_idle = max_idle

    def put(self, conn: _Connection) -> None:
        if len(self._idle) < self._max_idle and conn.usable():
            self._idle.append(conn)
        else:
            conn.close()

    async def _open(self) -> _Connection:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(self.host, self.port, limit=READ_SIZE * 4)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to the engine at {self.host}:{self.port}: {exc!r}") from exc
        return _Connection(reader, writer)

    async def request(
        self, method: str, target: str, headers: Sequence[tuple[bytes, bytes]] = (), body: bytes = b""
    ) -> UpstreamResponse:
        """Send a request (`target`: path and query) and read the response's head."""
        start = self._starts.get((method, target))
        if start is None:
            if len(self._starts) >= MAX_STARTS:
                self._starts.clear()
            start = f"{method} {self.prefix}{target} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n".encode()
            self._starts[(method, target)] = start
        head = [start]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        if body or method not in ("GET", "HEAD"):
            head += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        head.append(b"\r\n")
        head.append(body)
        message = b"".join(head)
        while self._idle:
            conn = self._idle.pop()
            if not conn.usable():
                conn.close()
                continue
            response = await self._exchange(conn, method, message, retry=True)
            if response is not None:
                return response
        response = await self._exchange(await self._open(), method, message, retry=False)
        assert response is not None
        return response

    async def _exchange(
        self, conn: _Connection, method: str, message: bytes, retry: bool
    ) -> UpstreamResponse | None:
        """The response's head; None when a reused connection turns out closed before any
        of it came (`retry`: the caller sends the request again on another)."""
        try:
            conn.writer.write(message)
            raw_head = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            conn.close()
            if retry and not exc.partial:
                return None
            raise UpstreamError("the engine closed the connection before answering") from exc
        except (OSError, asyncio.LimitOverrunError) as exc:
            conn.close()
            if retry and isinstance(exc, ConnectionResetError):
                return None
            raise UpstreamError(f"the engine did not answer: {exc!r}") from exc
        lines = raw_head.decode("latin-1").split("\r\n")  # one decode of the whole head
        status_line = lines[0].split(" ", 2)
        try:
            status = int(status_line[1])
        except (IndexError, ValueError) as exc:
            conn.close()
            raise UpstreamError(f"the engine's answer is not HTTP: {lines[0][:80]!r}") from exc
        pairs: list[tuple[str, str]] = []
        for line in lines[1:-2]:
            name, _, value = line.partition(":")
            pairs.append((name.strip(" \t").lower(), value.strip(" \t")))  # OWS: SP, HTAB
        headers = ResponseHeaders(pairs)
        keep = status_line[0] == "HTTP/1.1" and _get(headers, "connection", "").lower() != "close"
        try:
            return UpstreamResponse(self, conn, status, headers, keep, bodyless=method == "HEAD")
        except UpstreamError:
            conn.close()
            raise

    async def get(self, target: str) -> tuple[int, bytes]:
        """A GET answered in whole: (status, body)."""
        response = await self.request("GET", target)
        return response.status_code, await response.aread()

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()
