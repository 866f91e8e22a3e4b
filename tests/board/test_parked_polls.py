"""Long-polls answered in the HTTP protocol itself (`api.longpoll.LongPollProtocol`,
`ParkedPolls`): a parked poll holds no task, a commit is answered before the polls it
wakes, and uvicorn's request cycle still holds (pipelining, `Connection: close`, a client
that leaves, a head of a new epoch at the same version, the board stopping).

Every check is an order of events or a state reached, never a duration: the server side
notes its writes in order (`Recorder`), and a socket's answers come in request order."""

from __future__ import annotations

import json
import resource
import signal
import socket
from typing import Any, BinaryIO

import pytest

from deltaboard.clients.board_client import BoardClient
from tests.support.in_process_board import ADMIN, READ, in_process_board
from tests.support.manifests import publish
from tests.support.servers import BoardServer, wait_until

POLLERS = 1000


def get(path: str, token: str, extra: str = "", version: str = "1.1") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: b\r\nAuthorization: Bearer {token}\r\n{extra}\r\n".encode()


def poll(after: int, token: str, wait: float = 30, extra: str = "", version: str = "1.1") -> bytes:
    return get(f"/v1/runs/r/head?after={after}&wait={wait}", token, extra, version)


def read_answer(reader: BinaryIO) -> tuple[bytes, dict[str, Any]]:
    """The next HTTP answer from a socket's reader (`socket.makefile("rb")`, one per
    socket: it may hold the next pipelined answer already): its head, lowercase, and its
    JSON body."""
    lines = []
    while (line := reader.readline()) not in (b"\r\n", b""):
        lines.append(line)
    head = b"".join(lines).lower()
    assert head, "the connection closed"
    length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
    return head, json.loads(reader.read(length))


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=120)


def test_parked_polls_hold_no_task_and_a_commit_is_answered_before_its_wakes(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 3 * POLLERS:  # a socket on each side of each poller, in this one process
        wanted = 4 * POLLERS if hard == resource.RLIM_INFINITY else min(hard, 4 * POLLERS)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    with in_process_board(tmp_path) as board, BoardClient(board.url, ADMIN) as client:
        epoch = at_version_zero(client)
        pollers = [connect(board.port) for _ in range(POLLERS)]
        try:
            for sock in pollers:
                sock.sendall(poll(0, READ))
            wait_until(lambda: board.waiting() == POLLERS, "every poll parked", None, None, timeout=120)
            assert not board.server.server_state.tasks  # no ASGI request runs for them
            publish(client, "r", 1, epoch, {"w": b"one"})
            for sock in pollers:
                head, answer = read_answer(sock.makefile("rb"))
                assert head.startswith(b"http/1.1 200") and answer["version"] == 1
        finally:
            for sock in pollers:
                sock.close()
        commit = max(i for i, w in enumerate(board.writes) if w.startswith(b"HTTP/1.1 201"))
        woken = [
            i for i, w in enumerate(board.writes) if w.startswith(b"HTTP/1.1 200") and b'"version":1' in w
        ]
        assert len(woken) == POLLERS
        assert commit < min(woken)  # the commit's answer went out before the first wake
        wait_until(lambda: board.waiting() == 0, "the pollers gone", None, None)


def at_version_zero(client: BoardClient) -> int:
    """Run `r` with version 0 committed; returns its writer's epoch."""
    client.create_run("r")
    epoch = client.acquire_lease("r", "t").epoch
    publish(client, "r", 0, epoch, {"w": b"zero"})
    return epoch


def park(client: BoardClient, sock: socket.socket, request: bytes) -> None:
    """Send a poll (and what is pipelined behind it) and wait until the board parked it."""
    sock.sendall(request)
    wait_until(lambda: parked(client) == 1, "the poll parked", None, None)


def parked(client: BoardClient) -> float:
    """The board's `deltaboard_long_polls` gauge."""
    for line in client.metrics().splitlines():
        if line.startswith("deltaboard_long_polls "):
            return float(line.split()[1])
    raise AssertionError("no deltaboard_long_polls in /metrics")


def written_yet(sock: socket.socket) -> bytes:
    """What the board has written to `sock` so far (on loopback a write is in the peer's
    buffer when the writer returns)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b""
    finally:
        sock.settimeout(timeout)


def test_a_pipelined_request_waits_for_the_parked_poll(board: BoardServer):
    c = board.client()
    epoch = at_version_zero(c)
    with connect(board.port) as sock, sock.makefile("rb") as reader:
        park(c, sock, poll(0, board.read_token) + get("/v1/runs/r/manifests/0", board.read_token))
        early = written_yet(sock)
        assert early == b"", early  # the manifest waits behind the poll
        publish(c, "r", 1, epoch, {"w": b"one"})
        assert read_answer(reader)[1]["version"] == 1
        assert read_answer(reader)[1]["version"] == 0  # the manifest, answered second


def test_a_new_epochs_head_at_the_polled_version_does_not_answer_the_poll(board: BoardServer):
    c = board.client()
    epoch = at_version_zero(c)
    with connect(board.port) as sock, sock.makefile("rb") as reader:
        park(c, sock, poll(0, board.read_token))
        stolen = c.acquire_lease("r", "t2", steal=True).epoch
        assert stolen > epoch and c.head("r").epoch == stolen  # the head moved, its version did not
        c.metrics()  # a round trip after the head's wake-up ran
        assert written_yet(sock) == b""
        publish(c, "r", 1, stolen, {"w": b"one"})
        answer = read_answer(reader)[1]
        assert answer["version"] == 1 and answer["epoch"] == stolen


@pytest.mark.parametrize(("extra", "version"), [("Connection: close\r\n", "1.1"), ("", "1.0")])
def test_a_poll_that_asks_to_close_is_answered_then_closed(board: BoardServer, extra: str, version: str):
    c = board.client()
    epoch = at_version_zero(c)
    with connect(board.port) as sock, sock.makefile("rb") as reader:
        park(c, sock, poll(0, board.read_token, extra=extra, version=version))
        publish(c, "r", 1, epoch, {"w": b"one"})
        head, answer = read_answer(reader)
        assert answer["version"] == 1 and b"connection: close" in head
        assert reader.read(1) == b""  # closed by the board


def test_a_poll_whose_wait_ends_gets_the_current_head_and_the_connection_stays(board: BoardServer):
    at_version_zero(board.client())
    with connect(board.port) as sock, sock.makefile("rb") as reader:
        sock.sendall(poll(0, board.read_token, wait=0.2))
        head, answer = read_answer(reader)
        assert head.startswith(b"http/1.1 200") and answer["version"] == 0
        sock.sendall(poll(-1, board.read_token))  # same connection
        assert read_answer(reader)[1]["version"] == 0


def test_a_poller_that_leaves_is_forgotten(board: BoardServer):
    c = board.client()
    epoch = at_version_zero(c)
    sock = connect(board.port)
    park(c, sock, poll(0, board.read_token))
    sock.close()
    wait_until(lambda: parked(c) == 0, "the poll forgotten", None, None)
    publish(c, "r", 1, epoch, {"w": b"one"})  # wakes nobody, writes to no closed connection
    assert c.head("r").version == 1


def test_a_stopping_board_answers_its_parked_polls(board: BoardServer):
    c = board.client()
    at_version_zero(c)
    with connect(board.port) as sock, sock.makefile("rb") as reader:
        park(c, sock, poll(0, board.read_token))
        assert board.process is not None
        board.process.send_signal(signal.SIGTERM)
        head, answer = read_answer(reader)
        assert answer["version"] == 0 and b"connection: close" in head
        assert reader.read(1) == b""


def test_the_gauge_counts_parked_polls_and_event_streams_together(board: BoardServer):
    c = board.client()
    at_version_zero(c)
    poller, stream = connect(board.port), connect(board.port)
    try:
        park(c, poller, poll(0, board.read_token))
        stream.sendall(get("/v1/runs/r/events", board.read_token))
        wait_until(lambda: parked(c) == 2, "the stream counted beside the poll", None, None)
        stream.close()
        wait_until(lambda: parked(c) == 1, "the stream gone", None, None)
    finally:
        poller.close()
        stream.close()
    wait_until(lambda: parked(c) == 0, "the poll gone", None, None)
