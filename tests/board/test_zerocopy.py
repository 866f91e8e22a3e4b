"""Blob downloads by `sendfile` (`board.server.api.zerocopy`): the bytes, ranges and HTTP
framing of a download are those of the read path, through a socket that fills, a client
that goes away, and requests pipelined behind a download."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from deltaboard.board.server.api.zerocopy import SEND_NICE, send_blocking, senders

BLOB = 8 * 2**20 + 17  # larger than a loopback socket's buffer: the sender must wait


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(sender, receiver): the sender non-blocking with a small buffer, as a busy one is."""
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sender.setblocking(False)
    return sender, receiver


def receive(sock: socket.socket, size: int, into: bytearray) -> None:
    while len(into) < size:
        chunk = sock.recv(65536)
        if not chunk:
            return
        into += chunk


@pytest.fixture
def blob(tmp_path):
    data = os.urandom(BLOB)
    path = tmp_path / "blob"
    path.write_bytes(data)
    with open(path, "rb") as f:
        yield f.fileno(), data


def test_a_file_range_leaves_whole_through_a_full_socket(blob):
    fd, data = blob
    sender, receiver = socket_pair()
    got = bytearray()
    reader = threading.Thread(target=receive, args=(receiver, BLOB - 10, got))
    reader.start()
    send_blocking(os.dup(sender.fileno()), fd, 5, BLOB - 10)
    reader.join(60)
    assert bytes(got) == data[5:-5]


def test_a_client_that_takes_nothing_is_given_up(blob):
    fd, _ = blob
    sender, _receiver = socket_pair()
    with pytest.raises(TimeoutError):
        send_blocking(os.dup(sender.fileno()), fd, 0, BLOB, stall_s=0.2)


def test_a_client_gone_ends_the_send(blob):
    fd, _ = blob
    sender, receiver = socket_pair()
    receiver.close()
    with pytest.raises(OSError):
        send_blocking(os.dup(sender.fileno()), fd, 0, BLOB)


def test_a_file_shorter_than_promised_is_an_error(blob):
    fd, _ = blob
    sender, receiver = socket_pair()
    reader = threading.Thread(target=receive, args=(receiver, BLOB, bytearray()))
    reader.start()
    with pytest.raises(EOFError):
        send_blocking(os.dup(sender.fileno()), fd, 0, BLOB + 1)
    sender.close()
    reader.join(60)


def test_the_sending_threads_yield_the_cpu_to_the_event_loop():
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert senders().submit(niceness).result(60) == min(19, niceness() + SEND_NICE)


def read_answer(sock: socket.socket, buffer: bytearray) -> tuple[bytes, bytes]:
    """One HTTP/1.1 answer with a Content-Length from `sock` (leftovers stay in `buffer`)."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, "the board closed the connection"
        buffer += chunk
    end = buffer.index(b"\r\n\r\n")
    head = bytes(buffer[:end])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(buffer) < end + 4 + length:
        chunk = sock.recv(1 << 20)
        assert chunk, "the board closed the connection"
        buffer += chunk
    body = bytes(buffer[end + 4 : end + 4 + length])
    del buffer[: end + 4 + length]
    return head, body


def test_downloads_through_the_board(board):
    c = board.client(board.publish_token)
    c.create_run("r")
    data = os.urandom(BLOB)
    sha = c.upload_blob("r", data)
    assert c.get_blob("r", sha, 0, BLOB) == data
    assert c.get_blob("r", sha, BLOB - 7, BLOB) == data[-7:]
    assert c.blob_size("r", sha) == BLOB  # HEAD: the head alone
    host, port = "127.0.0.1", int(board.url.rsplit(":", 1)[1])
    auth = f"Authorization: Bearer {board.read_token}\r\n"

    def get(path: str, extra: str = "") -> bytes:
        return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}{extra}\r\n".encode()

    # A download, a range, a HEAD and a head request pipelined on one connection: each
    # answer whole and in order after the download's bytes.
    blob_path = f"/v1/runs/r/blobs/{sha}"
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(
            get(blob_path)
            + get(blob_path, "Range: bytes=10-19\r\n")
            + f"HEAD {blob_path} HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode()
            + get("/v1/runs/r/head")
        )
        buffer = bytearray()
        head, body = read_answer(sock, buffer)
        assert head.startswith(b"HTTP/1.1 200") and body == data
        head, body = read_answer(sock, buffer)
        assert head.startswith(b"HTTP/1.1 206") and body == data[10:20]
        assert b"content-range: bytes 10-19/" in head.lower()
        while b"\r\n\r\n" not in buffer:
            buffer += sock.recv(65536)
        end = buffer.index(b"\r\n\r\n")
        assert (
            buffer.startswith(b"HTTP/1.1 200") and f"content-length: {BLOB}".encode() in buffer[:end].lower()
        )
        del buffer[: end + 4]
        head, body = read_answer(sock, buffer)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["run"] == "r"
    # A client that leaves half-way: the board serves the next one as before.
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(get(blob_path))
        assert sock.recv(65536)
    assert c.get_blob("r", sha, 0, BLOB) == data
