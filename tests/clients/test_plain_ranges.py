"""`PlainRanges`: a plain answer is read exactly, on one kept-alive connection; any other
answer (an error, a redirect, a wrong range, a chunked or cut body) gives None, so that the
follower asks through its `BoardClient` instead, and the next read opens a new connection.

The server is a fake that answers each request with a scripted response (injected faults);
the reader against a real board is tested in tests/services/test_compact_keyframes.py."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from deltaboard.clients.follower.ranges import PlainRanges

BLOB = bytes(range(256)) * 4000  # 1,024,000 bytes: bodies larger than one socket read
Answer = Callable[[int, int], bytes]


def plain(start: int, end: int) -> bytes:
    body = BLOB[start:end]
    head = f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n"
    return f"{head}Content-Range: bytes {start}-{end - 1}/{len(BLOB)}\r\n\r\n".encode() + body


class FakeBoard:
    """Answers each request with `answers[i](start, end)` (the last one repeats), records
    the requests' heads and counts connections; an answer may end the connection."""

    def __init__(self, answers: list[Answer], close_after: frozenset[int] = frozenset()) -> None:
        self.answers = answers
        self.close_after = close_after  # requests (from 0) after whose answer the connection ends
        self.requests: list[str] = []
        self.connections = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        # a reader that gave up on an answer drops the connection mid-send
        with conn, contextlib.suppress(OSError):
            pending = b""
            while True:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                text = head.decode()
                self.requests.append(text)
                asked = next(line for line in text.split("\r\n") if line.startswith("Range: bytes="))
                start, end = (int(x) for x in asked.removeprefix("Range: bytes=").split("-"))
                answer = self.answers[min(len(self.requests) - 1, len(self.answers) - 1)]
                response = answer(start, end + 1)
                conn.sendall(response)
                if response.endswith(b"CLOSE") or len(self.requests) - 1 in self.close_after:
                    return

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeBoard]]:
    made: list[FakeBoard] = []

    def make(answers: list[Answer], close_after: frozenset[int] = frozenset()) -> FakeBoard:
        made.append(FakeBoard(answers, close_after))
        return made[-1]

    yield make
    for board in made:
        board.close()


def test_plain_answers_are_read_exactly_on_one_connection(fake) -> None:
    board = fake([plain])
    ranges = PlainRanges(board.url + "/base", {"Authorization": "Bearer t"}, timeout=30)
    try:
        for start, end in [(0, 10), (5, len(BLOB)), (1000, 301_000), (len(BLOB) - 1, len(BLOB))]:
            got = ranges.read("/v1/runs/r/blobs/abc", start, end)
            assert got is not None and bytes(got) == BLOB[start:end]
    finally:
        ranges.close()
    assert board.connections == 1
    assert all(r.startswith("GET /base/v1/runs/r/blobs/abc HTTP/1.1\r\n") for r in board.requests)
    assert all("\r\nAuthorization: Bearer t" in r for r in board.requests)


def _error(start: int, end: int) -> bytes:
    body = b'{"error": {"code": "unknown_blob", "message": "no"}}'
    return b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def _redirect(start: int, end: int) -> bytes:
    return b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://store/x\r\nContent-Length: 0\r\n\r\n"


def _wrong_range(start: int, end: int) -> bytes:
    return plain(start + 1, end + 1)


def _whole_for_a_range(start: int, end: int) -> bytes:
    body = BLOB[start:end]
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def _chunked(start: int, end: int) -> bytes:
    body = BLOB[start:end]
    return (
        b"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body)
        + body
        + b"\r\n0\r\n\r\n"
    )


def _cut(start: int, end: int) -> bytes:
    return plain(start, end)[: -(end - start) // 2] + b"CLOSE"


@pytest.mark.parametrize("answer", [_error, _redirect, _wrong_range, _whole_for_a_range, _chunked, _cut])
def test_any_other_answer_is_none_and_the_next_read_starts_over(fake, answer: Answer) -> None:
    board = fake([answer, plain])
    ranges = PlainRanges(board.url, {}, timeout=30)
    try:
        assert ranges.read("/b", 10, 200_010) is None
        got = ranges.read("/b", 10, 200_010)
        assert got is not None and bytes(got) == BLOB[10:200_010]
    finally:
        ranges.close()
    assert board.connections == 2


def test_a_connection_the_board_closed_while_idle_is_replaced(fake) -> None:
    """The board ends a kept connection (idle timeout) between two reads: the second read
    is asked again on a new connection, not handed back to the client."""
    board = fake([plain], close_after=frozenset({0}))
    ranges = PlainRanges(board.url, {}, timeout=30)
    try:
        first = ranges.read("/b", 0, 100)
        assert first is not None and bytes(first) == BLOB[:100]
        second = ranges.read("/b", 100, 300_100)
        assert second is not None and bytes(second) == BLOB[100:300_100]
    finally:
        ranges.close()
    assert board.connections == 2


def test_a_board_that_is_gone_is_none() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
    assert PlainRanges(url, {}, timeout=5).read("/b", 0, 10) is None
