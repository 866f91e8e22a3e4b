"""An engine whose answer is not framed as HTTP says (a negative chunk size, a payload
without its CRLF, a size `int` would take but HTTP does not, a bad content-length), through
a real sidecar process: each is a clean upstream failure. The client of a plain request
gets the sidecar's JSON 503, a stream ends with an error event, the engine's connection is closed
(not pooled), and the sidecar goes on serving. The sidecar runs in a process of its own
so that a decoder that loops for ever (as `_Chunks.feed` did on a negative size) fails the
test at the client's timeout and is killed with the process, instead of hanging it."""

from __future__ import annotations

import json
import multiprocessing
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psutil

from deltaboard.services.bench.sidecar_bench import BenchConfig, sidecar_process
from tests.services.fakes.polling import wait_until

CLIENT_TIMEOUT_S = 20.0  # a bound on a hang, not a timing assertion
EVENT = b'data: {"i": 0}\n\n'
GOOD_BODY = b'{"ok": true}'
CHUNKED = "transfer-encoding: chunked"
PATH = "/v1/completions"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class FramingEngine:
    """An engine on a raw socket, a thread per connection. `GET /health` gets its stamp; a
    `POST` gets the answer its JSON body spells (`head` lines, then `body`, latin-1); after
    a `bad` one its connection is left open and only watched: `ended` counts the
    connections the sidecar closed after such an answer (a sidecar that waited for more bytes would wait
    for ever, and one that pooled the connection would not close it)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.ended = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(line[15:])
                            for line in head.lower().split(b"\r\n")
                            if line.startswith(b"content-length:")
                        ),
                        0,
                    )
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    body, buf = buf[:length], buf[length:]
                    if head.startswith(b"GET /health"):
                        stamp = json.dumps({"weight_version": None, "loads": 1}).encode()
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(stamp), stamp))
                        continue
                    ask = json.loads(body)
                    answer = "".join(f"{line}\r\n" for line in ask["head"]) + "\r\n" + ask["body"]
                    conn.sendall(b"HTTP/1.1 200 OK\r\n" + answer.encode("latin-1"))
                    if not ask["bad"]:
                        continue
                    while conn.recv(65536):  # nothing more is answered here: the sidecar must close
                        pass
                    with self._lock:
                        self.ended += 1
                    return
            except ConnectionResetError:  # the sidecar aborts a connection it gives up
                with self._lock:
                    self.ended += 1

    def close(self) -> None:
        self._listener.close()


@contextmanager
def sidecar(engine_url: str) -> Iterator[str]:
    """A sidecar process of one worker in front of `engine_url` (no swaps after its first)."""
    context = multiprocessing.get_context("spawn")
    port, port_end = context.Pipe()
    config = BenchConfig(workers=1, swap_every_s=3600.0)
    process = context.Process(target=sidecar_process, args=(engine_url, config, port_end))
    process.start()
    try:
        wait_until(lambda: port.poll() or not process.is_alive(), "the sidecar started")
        yield f"http://127.0.0.1:{port.recv()}"
    finally:  # killed, worker first: a worker stuck in a loop does not turn to its SIGTERM handler
        for worker in psutil.Process(process.pid).children(recursive=True):
            worker.kill()
        process.kill()
        process.join(10)


def _ask(head: str, body: bytes, stream: bool, bad: bool) -> dict[str, Any]:
    """A request's body that tells the engine its answer: `head`, then `body`."""
    kind = "text/event-stream" if stream else "application/json"
    return {
        "head": [f"content-type: {kind}", head],
        "body": body.decode("latin-1"),
        "bad": bad,
        "stream": stream,
    }


def _answered_cleanly(client: httpx.Client, engine: FramingEngine, what: str, ask: dict[str, Any]) -> None:
    """The sidecar's answer to a request the engine answers with `ask`'s bad framing: a 503
    `EngineUnavailable`, or, for a stream whose head goes out before its body fails, a
    stream that ends with an `EngineUnavailable` error event after the whole events the
    engine sent before it (not a cut connection); the engine's connection closed."""
    closed = engine.ended
    if ask["stream"] and ask["head"][1] == CHUNKED:
        with client.stream("POST", PATH, json=ask) as response:
            assert response.status_code == 200, what
            body = response.read()  # a connection cut mid-body raises here
        *sent, last = body.split(b"\n\n")[:-1]
        assert all(event + b"\n\n" == EVENT for event in sent), (what, body)
        assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == "EngineUnavailable", (what, body)
    else:
        response = client.post(PATH, json=ask)
        assert response.status_code == 503, (what, response.text)
        assert response.json()["error"]["code"] == "EngineUnavailable", what
    wait_until(lambda: engine.ended > closed, f"{what}: the engine's connection closed", CLIENT_TIMEOUT_S)


def test_an_engines_malformed_framing_is_an_upstream_failure_and_nothing_hangs() -> None:
    cases = [
        ("a negative chunk size", CHUNKED, _chunk(EVENT) + b"-6\r\n" + EVENT),
        ("a payload without its CRLF", CHUNKED, _chunk(EVENT) + b"5\r\nhello!!" + _chunk(EVENT)),
        ("a signed chunk size", CHUNKED, _chunk(EVENT) + b"+5\r\nhello\r\n"),
        ("a hex prefix", CHUNKED, _chunk(EVENT) + b"0x5\r\nhello\r\n"),
        ("no digits", CHUNKED, _chunk(EVENT) + b"zz\r\n"),
        ("a size line that does not end", CHUNKED, _chunk(EVENT) + b"a" * 5000),
        ("a negative content-length", "content-length: -3", b"abc"),
    ]
    good = _ask(f"content-length: {len(GOOD_BODY)}", GOOD_BODY, stream=False, bad=False)
    engine = FramingEngine()
    try:
        with sidecar(engine.url) as url, httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            for what, head, body in cases:
                for stream in (False, True):
                    _answered_cleanly(
                        client, engine, f"{what}, stream={stream}", _ask(head, body, stream, bad=True)
                    )
                    answer = client.post(PATH, json=good)  # served after it, on another connection
                    assert answer.status_code == 200, (what, answer.text)
                    assert answer.json() == {
                        "ok": True,
                        "weight_version": {"start": 0, "end": 0, "spans": [[0, 0]]},
                    }
    finally:
        engine.close()
