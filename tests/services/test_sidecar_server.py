"""The sidecar's HTTP/1.1 connection (`services.sidecar.server`): what it writes, write by
write, for the answers of small ASGI apps, and through the real proxy in front of a real
engine. The transport records the writes (the protocol's own socket is what the other
sidecar tests use, through `BackgroundServer`); the apps and the proxy are real."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from deltaboard.clients.engines import make_adapter
from deltaboard.services.sidecar.background import BackgroundServer
from deltaboard.services.sidecar.gate import VersionGate
from deltaboard.services.sidecar.metrics import WAIT_BUCKETS, SidecarMetrics
from deltaboard.services.sidecar.proxy import InferenceRoutes, ProxySettings, create_proxy_app
from deltaboard.services.sidecar.server import DISCONNECT, SidecarProtocol
from deltaboard.services.sidecar.upstream import UpstreamPool, _Chunks, whole_chunks
from tests.services.fakes.echo import echo_engine

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
TIMEOUT_S = 60.0


class Recording:
    """A transport that keeps what is written, write by write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1234)


class State:
    def __init__(self) -> None:
        self.connections: set[Any] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.default_headers = [(b"server", b"test")]
        self.total_requests = 0


class Config:
    timeout_keep_alive = 5.0


def connect(app: App) -> tuple[SidecarProtocol, Recording, State]:
    state = State()
    protocol = SidecarProtocol(Config(), state, {}, asyncio.get_running_loop(), app=app)
    transport = Recording()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport, state


async def answered(state: State, count: int) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        while state.total_requests < count:
            await asyncio.sleep(0.001)


def post(path: str, body: bytes, *headers: bytes) -> bytes:
    head = b"".join(h + b"\r\n" for h in headers)
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s" % (
        path.encode(),
        len(body),
        head,
        body,
    )


async def json_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    message = await receive()
    body = json.dumps({"path": scope["path"], "got": message["body"].decode()}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def test_an_answer_with_its_length_leaves_in_one_write_head_and_body() -> None:
    async def main() -> None:
        protocol, transport, state = connect(json_app)
        protocol.data_received(post("/a", b"hi"))
        await answered(state, 1)
        body = b'{"path": "/a", "got": "hi"}'
        assert transport.writes == [
            b"HTTP/1.1 200 OK\r\nserver: test\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        ]
        assert not transport.closed  # kept alive for the next request

    asyncio.run(main())


def test_pipelined_requests_are_answered_in_order_and_connection_close_closes() -> None:
    async def main() -> None:
        protocol, transport, state = connect(json_app)
        protocol.data_received(post("/1", b"a") + post("/2", b"b", b"connection: close"))
        await answered(state, 2)
        assert [json.loads(w.split(b"\r\n\r\n", 1)[1])["path"] for w in transport.writes] == ["/1", "/2"]
        assert b"connection: close\r\n" in transport.writes[1] and transport.closed

    asyncio.run(main())


def test_a_stream_writes_its_head_when_the_app_waits_then_a_chunk_per_part_and_its_end_with_the_last() -> (
    None
):
    async def main() -> None:
        later = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await receive()
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await later.wait()  # the first event is not there yet: the head goes alone
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

        protocol, transport, state = connect(app)
        protocol.data_received(post("/s", b""))
        async with asyncio.timeout(TIMEOUT_S):
            while not transport.writes:
                await asyncio.sleep(0.001)
        assert transport.writes == [
            b"HTTP/1.1 200 OK\r\nserver: test\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        ]
        later.set()
        await answered(state, 1)
        assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"]

    asyncio.run(main())


def test_expect_100_continue_head_requests_and_errors_as_json() -> None:
    async def main() -> None:
        protocol, transport, state = connect(json_app)
        protocol.data_received(post("/c", b"x", b"expect: 100-continue"))
        await answered(state, 1)
        assert transport.writes[0] == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert transport.writes[1].endswith(b'{"path": "/c", "got": "x"}')

        async def head_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
            await send({"type": "http.response.body", "body": b""})

        protocol, transport, state = connect(head_app)
        protocol.data_received(b"HEAD /h HTTP/1.1\r\nhost: x\r\n\r\n")
        await answered(state, 1)
        assert transport.writes == [b"HTTP/1.1 200 OK\r\nserver: test\r\nx-a: 1\r\n\r\n"]

        async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
            raise ValueError("boom")

        protocol, transport, state = connect(failing)
        protocol.data_received(post("/f", b""))
        await answered(state, 1)
        assert transport.writes[0].startswith(b"HTTP/1.1 500 ") and transport.closed
        assert error_of(transport.writes[0]) == "Internal"

        protocol, transport, state = connect(json_app)
        protocol.data_received(b"GET /x HTTP/1.1\r\nbad header line\r\n\r\n")
        assert transport.writes[0].startswith(b"HTTP/1.1 400 ") and transport.closed
        assert error_of(transport.writes[0]) == "BadRequest"

    asyncio.run(main())


def test_targets_split_into_path_and_query_whether_plain_or_not() -> None:
    async def main() -> None:
        seen: list[tuple[str, bytes, bytes]] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            seen.append((scope["path"], scope["raw_path"], scope["query_string"]))
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        targets = [b"/v1/completions", b"/a?b=1&c", b"/a%20b", b"/x#frag", b"http://h/p?q", b"/"]
        protocol, _, state = connect(app)
        for target in targets:
            protocol.data_received(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % target)
            await answered(state, len(seen) + 1)
        assert seen == [
            ("/v1/completions", b"/v1/completions", b""),
            ("/a", b"/a", b"b=1&c"),
            ("/a b", b"/a%20b", b""),
            ("/x", b"/x", b""),
            ("/p", b"/p", b"q"),
            ("/", b"/", b""),
        ]

    asyncio.run(main())


def test_a_header_holding_a_line_break_is_refused_and_nothing_of_it_is_written() -> None:
    async def main() -> None:
        for name, value in ((b"x-a", b"1\r\nx-b: 2"), (b"x-a", b"1\n"), (b"x\ra", b"1")):

            async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
                headers = [(b"content-type", b"text/plain"), (name, value)]  # noqa: B023
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": b"x"})

            protocol, transport, state = connect(app)
            protocol.data_received(post("/h", b""))
            await answered(state, 1)
            assert len(transport.writes) == 1 and transport.closed
            assert error_of(transport.writes[0]) == "Internal"

    asyncio.run(main())


def test_a_body_that_comes_after_the_app_asked_for_it_wakes_the_app() -> None:
    async def main() -> None:
        parts: list[bytes] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            more = True
            while more:
                message = await receive()
                parts.append(message["body"])
                more = message["more_body"]
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"".join(parts)})

        protocol, transport, state = connect(app)
        request = post("/late", b"hello")
        protocol.data_received(request[:-3])  # the head and part of the body
        for _ in range(3):
            await asyncio.sleep(0)
        assert parts == [b"he"] and not transport.writes  # the app waits for the rest
        protocol.data_received(request[-3:])
        await answered(state, 1)
        assert parts == [b"he", b"llo"] and transport.writes[0].endswith(b"\r\n5\r\nhello\r\n0\r\n\r\n")

    asyncio.run(main())


def error_of(answer: bytes) -> str:
    """The `code` of an error answer (asserting it is the sidecar's JSON error shape)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head and b"connection: close" in head
    return str(json.loads(body)["error"]["code"])


def test_a_client_that_goes_away_is_told_to_the_app_by_callback_and_by_receive() -> None:
    async def main() -> None:
        told, watching = asyncio.Event(), asyncio.Event()
        seen: list[str] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            scope["extensions"][DISCONNECT](told.set)
            assert (await receive())["type"] == "http.request"
            watching.set()
            seen.append((await receive())["type"])  # waits until the client is gone

        protocol, _, state = connect(app)
        protocol.data_received(post("/d", b"x"))
        async with asyncio.timeout(TIMEOUT_S):
            await watching.wait()
        protocol.connection_lost(None)
        async with asyncio.timeout(TIMEOUT_S):
            await told.wait()
        await answered(state, 1)
        assert seen == ["http.disconnect"] and not state.connections

    asyncio.run(main())


@asynccontextmanager
async def proxy_app(engine_url: str) -> AsyncIterator[InferenceRoutes]:
    """The sidecar's app (quiesce mode) in front of the engine at `engine_url`, serving
    version 3, on this event loop."""
    gate = VersionGate("quiesce")

    @asynccontextmanager
    async def no_lifespan(app: Any) -> AsyncIterator[None]:
        yield

    gate.bind(asyncio.get_running_loop())
    adapter = make_adapter("reference", engine_url)
    status = lambda: {"served": gate.served}  # noqa: E731
    app = create_proxy_app(gate, adapter, ProxySettings(engine_url), SidecarMetrics(), status, no_lifespan)
    loaded = await asyncio.to_thread(adapter.loaded)
    await asyncio.to_thread(gate.end_swap, 3, 0.0, loaded)
    try:
        yield app
    finally:
        await app.proxy.pool.aclose()
        adapter.close()


def test_a_stream_through_the_proxy_passes_byte_exact_and_ends_in_the_write_of_its_last_event() -> None:
    """The echo engine's events, through the real proxy on this connection: the same bytes,
    the range in its own event before [DONE], and the body's end in the same write."""
    with BackgroundServer(echo_engine()) as engine:

        async def main() -> None:
            async with proxy_app(engine.url) as app:
                protocol, transport, state = connect(app)
                body = json.dumps({"stream": True, "n": 2, "weight_version": {"min": 3}}).encode()
                protocol.data_received(post("/v1/completions", body, b"content-type: application/json"))
                await answered(state, 1)
            head, _, chunked = b"".join(transport.writes).partition(b"\r\n\r\n")
            assert b"x-weight-version-start: 3" in head and b"transfer-encoding: chunked" in head
            stamp = {"choices": [], "weight_version": {"start": 3, "end": 3, "spans": [[0, 3]]}}
            expected = b': a comment\n\ndata: {"i": 0}\n\ndata: {"i": 1}\n\n' + (
                b"data: " + json.dumps(stamp).encode() + b"\n\ndata: [DONE]\n\n"
            )
            assert _unchunk(chunked) == expected
            assert transport.writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")

        asyncio.run(main())


def test_answered_requests_leave_no_reference_cycle_to_the_garbage_collector() -> None:
    """A request's objects (its `_Cycle`, its task, the proxy's `_Watch`, ...) are freed by
    their reference counts once it is answered, with the collector off: the scope's
    extensions and the disconnect callback lead back to the request, and the server cuts
    them. Left to the collector, they made its passes, which stall the sidecar's loop."""
    with BackgroundServer(echo_engine()) as engine:

        async def main() -> list[str]:
            async with proxy_app(engine.url) as app:
                protocol, _, state = connect(app)
                gc.collect()
                gc.disable()
                try:
                    for i, stream in enumerate([False, True, False, True]):
                        body = json.dumps({"stream": stream, "n": 2, "weight_version": {"min": 3}})
                        protocol.data_received(
                            post("/v1/completions", body.encode(), b"content-type: application/json")
                        )
                        await answered(state, i + 1)
                    async with asyncio.timeout(TIMEOUT_S):
                        while state.tasks:  # each request's task ends after its answer
                            await asyncio.sleep(0.001)
                    gc.set_debug(gc.DEBUG_SAVEALL)
                    gc.collect()
                    kinds = (f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
                    return [kind for kind in kinds if kind.startswith("deltaboard.services.sidecar")]
                finally:
                    gc.set_debug(0)
                    gc.garbage.clear()
                    gc.enable()

        assert asyncio.run(main()) == []


def test_a_forwarded_stream_goes_to_the_callback_then_to_the_reader_every_byte_once_in_order() -> None:
    """`UpstreamResponse.forward` hands the reads to a callback from the connection's own
    protocol until the callback says stop; the rest is read by `aiter_raw` from the same
    connection, nothing lost or repeated. The engine here sends its events in three bursts,
    each when the test says, so that the stop falls in a read the forwarding protocol gets."""

    def chunk(payload: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(payload), payload)

    def events(first: int, stop: int) -> bytes:
        return b"".join(chunk(b'data: {"i": %d}\n\n' % i) for i in range(first, stop))

    async def main() -> tuple[bytes, bytes]:
        bursts = [asyncio.Event(), asyncio.Event()]

        async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            writer.write(head + events(0, 10))
            await bursts[0].wait()
            writer.write(events(10, 30))
            await bursts[1].wait()
            writer.write(events(30, 50) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()

        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        pool = UpstreamPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        async with asyncio.timeout(TIMEOUT_S):
            response = await pool.request("GET", "/stream")
            seen: list[bytes] = []

            def on_data(payload: bytes) -> bool:
                seen.append(payload)
                return b'"i": 20}' not in payload

            forwarding = asyncio.ensure_future(response.forward(on_data, lambda: None))
            while b'"i": 9}' not in b"".join(seen):
                await asyncio.sleep(0.001)
            bursts[0].set()  # what comes now reaches the forwarding protocol, and stops it
            await forwarding
            bursts[1].set()  # what comes now is the reader's again
            rest = [part async for part in response.aiter_raw()]
        await pool.aclose()
        server.close()
        return b"".join(seen), b"".join(rest)

    forwarded, rest = asyncio.run(main())
    expected = b"".join(b'data: {"i": %d}\n\n' % i for i in range(50)) + b"data: [DONE]\n\n"
    assert forwarded + rest == expected
    assert b'"i": 20}' in forwarded and b'"i": 49}' in rest  # the stop in a forwarded read


@pytest.mark.parametrize("write_size", [1, 7, 1 << 20])
def test_a_chunked_body_reads_the_same_however_the_engine_splits_its_writes(write_size: int) -> None:
    """The chunked decoder (`UpstreamResponse.aiter_raw`) gives the body's payload whatever
    falls into one read: a size line, a payload or its CRLF cut anywhere, chunk extensions,
    a read ending with a chunk or inside one, trailers after the last."""
    payloads = [b"data: %d\n\n" % i * (i % 5 + 1) for i in range(40)]
    body = b"".join(
        b"%x%s\r\n%s\r\n" % (len(p), b";ext=1" if i % 7 == 3 else b"", p) for i, p in enumerate(payloads)
    )
    body += b"0\r\nx-trailer: 1\r\n\r\n"

    async def main() -> bytes:
        async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for at in range(0, len(body), write_size):
                writer.write(body[at : at + write_size])
                await writer.drain()
                await asyncio.sleep(0)  # the sidecar's read may take this write alone

        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        pool = UpstreamPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        async with asyncio.timeout(TIMEOUT_S):
            response = await pool.request("GET", "/stream")
            read = b"".join([part async for part in response.aiter_raw()])
        await pool.aclose()
        server.close()
        return read

    assert asyncio.run(main()) == b"".join(payloads)


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def test_reads_of_whole_event_chunks_are_told_from_the_rest() -> None:
    """`whole_chunks`: a read from one chunk's start to another's matches when every
    payload ends an event and holds no CR; a read that ends inside a chunk (a size line, a
    payload, its CRLF), the body's last chunk, a size with an extension, a payload not
    ending an event or with CRLF events do not. The decoder holds nothing after a read that
    matches (what passing it on as it came relies on)."""
    reads = whole_chunks(b"\n\n")
    events = [b'data: {"i": %d}\n\n' % i * (i % 3 + 1) for i in range(6)]
    body = b"".join(map(_chunk, events))
    bounds = [0]
    for event in events:
        bounds.append(bounds[-1] + len(_chunk(event)))
    for start in bounds[:-1]:
        for stop in range(start + 1, len(body) + 1):
            matched = reads.fullmatch(body[start:stop]) is not None
            assert matched == (stop in bounds), (start, stop)
            if matched:
                chunks = _Chunks()
                chunks.feed(body[start:stop])
                assert not chunks.held() and not chunks.done
    for other in (
        b"0\r\n\r\n",
        _chunk(events[0]) + b"0\r\n\r\n",
        b"%x;x=1\r\n%s\r\n" % (len(events[0]), events[0]),
        _chunk(b'data: {"i": 0}\n'),
        _chunk(b'data: {"i": 0}\r\n\r\n'),
        _chunk(b'data: {"i": 0}\r\n\n\n'),
    ):
        assert reads.fullmatch(other) is None, other


CHUNKED = b"transfer-encoding: chunked\r\n\r\n"


def test_a_stream_passes_reads_of_whole_events_as_they_came_and_the_rest_decoded() -> None:
    """Through the real proxy, an engine's stream in bursts (each read by the sidecar before
    the next is sent): reads of whole event chunks go to the client in one write as the
    engine framed them; a read with an event cut across chunks, the read after it (whole
    chunks, but the event's start is held), CRLF events and the end (whole chunks too) are
    decoded, and the client reads every event once, in order, the engine's versions out of
    its last event and the range before [DONE]."""
    bursts = [
        _chunk(b'data: {"i": 0}\n\n') + _chunk(b'data: {"i": 1}\n\n'),
        _chunk(b'data: {"i": 2}\n\ndata: {"i": 3'),
        _chunk(b"}\n\n") + _chunk(b'data: {"i": 4}\n\n'),
        _chunk(b'data: {"i": 5}\r\n\r\n'),
        _chunk(b'data: {"i": 6}\n\n'),
        _chunk(b'data: {"i": 7, "weight_version": {"spans": [[0, 3]]}}\n\n') + _chunk(b"data: [DONE]\n\n"),
        b"0\r\n\r\n",
    ]
    shown = [b'"i": 1}', b'"i": 2}', b'"i": 4}', b'"i": 5}', b'"i": 6}', b"[DONE]"]  # what each burst writes

    async def main() -> list[bytes]:
        sent = [asyncio.Event() for _ in bursts]

        async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line[15:])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if head.startswith(b"GET /health"):
                    body = json.dumps({"weight_version": None, "loads": 1}).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(body), body)
                    )
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + CHUNKED)
                for burst, event in zip(bursts, sent, strict=True):
                    await event.wait()
                    writer.write(burst)
                    await writer.drain()

        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        async with proxy_app(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}") as app:
            protocol, transport, state = connect(app)
            body = json.dumps({"stream": True, "weight_version": {"min": 3}}).encode()
            protocol.data_received(post("/v1/completions", body, b"content-type: application/json"))
            async with asyncio.timeout(TIMEOUT_S):
                for event, marker in zip(sent, [*shown, None], strict=True):
                    event.set()
                    while marker is not None and b"".join(transport.writes).find(marker) < 0:
                        await asyncio.sleep(0.001)
            await answered(state, 1)
        server.close()
        return transport.writes

    writes = asyncio.run(main())
    assert writes[0].endswith(b"\r\n\r\n" + bursts[0])  # the head, and the first read as it came
    assert bursts[4] in writes
    assert not any(w.find(bursts[2]) >= 0 or w.find(bursts[3]) >= 0 for w in writes)
    chunked = b"".join(writes).partition(b"\r\n\r\n")[2]
    stamp = {"choices": [], "weight_version": {"start": 3, "end": 3, "spans": [[0, 3]]}}
    expected = b"".join(b'data: {"i": %d}\n\n' % i for i in range(8))
    expected += b"data: " + json.dumps(stamp).encode() + b"\n\ndata: [DONE]\n\n"
    assert _unchunk(chunked) == expected


def _unchunk(data: bytes) -> bytes:
    out: list[bytes] = []
    pos = 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol], 16)
        if size == 0:
            assert data[eol:] == b"\r\n\r\n"
            return b"".join(out)
        out.append(data[eol + 2 : eol + 2 + size])
        assert data[eol + 2 + size : eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size


@pytest.mark.parametrize("waits", [[], [0.0, 0.0005, 0.01, 0.3, 2.0, 200.0], [1.0, 1.0, 60.0, 120.0]])
def test_the_per_request_series_read_as_prometheus_clients_own_would(waits: list[float]) -> None:
    metrics = SidecarMetrics()
    registry = CollectorRegistry()
    reference = Histogram(
        "deltaboard_sidecar_version_wait_seconds",
        "Time requests waited for their weight version",
        buckets=WAIT_BUCKETS,
        registry=registry,
    )
    for seconds in waits:
        metrics.waited(seconds)
        reference.observe(seconds)
    for outcome in ("proxied", "proxied", "gone"):
        metrics.count(outcome)

    def series(text: bytes, prefix: str) -> list[str]:
        return [line for line in text.decode().splitlines() if line.startswith(prefix)]

    wait = "deltaboard_sidecar_version_wait_seconds_"
    assert series(metrics.render(), wait + "bucket") == series(generate_latest(registry), wait + "bucket")
    for name in ("count", "sum"):
        assert series(metrics.render(), wait + name) == series(generate_latest(registry), wait + name)
    assert series(metrics.render(), "deltaboard_sidecar_requests_total") == [
        'deltaboard_sidecar_requests_total{outcome="gone"} 1.0',
        'deltaboard_sidecar_requests_total{outcome="proxied"} 2.0',
    ]
