"""Blob downloads through a board under the ways clients use a connection: a blob larger
than a socket's buffer, a range, a HEAD and a head request pipelined behind it on one
connection (each answer whole and in order), and a client that leaves half-way; and a
download's bytes leave by `sendfile` on the sending thread, never through the event
loop's transport, except for several ranges in one answer."""

from __future__ import annotations

import json
import os
import socket

import httpx

from deltaboard.clients.board_client import BoardClient
from tests.support.in_process_board import ADMIN, READ, in_process_board

BLOB = 8 * 2**20 + 17  # larger than a loopback socket's buffer: the board must wait


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


def test_a_download_leaves_by_sendfile_not_through_the_loop(tmp_path):
    data = os.urandom(BLOB)
    with in_process_board(tmp_path) as board, BoardClient(board.url, ADMIN) as client:
        client.create_run("r")
        sha = client.upload_blob("r", data)
        before = len(board.writes)
        with httpx.Client(base_url=board.url, headers={"Authorization": f"Bearer {READ}"}) as http:
            whole = http.get(f"/v1/runs/r/blobs/{sha}")
            ranged = http.get(f"/v1/runs/r/blobs/{sha}", headers={"Range": "bytes=100-2000099"})
            written = sum(len(w) for w in board.writes[before:])
            several = http.get(f"/v1/runs/r/blobs/{sha}", headers={"Range": "bytes=0-9,20-29"})
    assert whole.status_code == 200 and whole.content == data
    assert ranged.status_code == 206 and ranged.content == data[100:2000100]
    assert written < 4096  # the two answers' heads went through the transport, no body byte
    assert several.status_code == 206 and data[:10] in several.content and data[20:30] in several.content
