"""Ranged blob reads over plain HTTP/1.1 sockets, into buffers that each thread reuses.

A new node reads a worker keyframe (most of a view's bytes) by ranged GETs on several
threads. Through httpx each range costs several core-seconds per GB on the client: the
body arrives in 64 KiB reads, each parsed by h11 and copied through its buffer, and is
then joined into a fresh `bytes` (fresh pages, zeroed by the kernel). Here each thread
keeps one keep-alive connection to the board and reads a range's body with `recv_into`
straight into a buffer it reuses: one copy, out of the kernel.

Only the plain answer is read here: 206 (or 200 for a whole blob) with a Content-Length
and a `Content-Range` that is the one asked for. Anything else (an error, a redirect to
an object store, a chunked body, a dropped connection) closes the connection and returns
None, and the caller asks the `BoardClient`, which retries, follows redirects and raises
the typed errors. The client offers this path only for plain HTTP through its default
transport (`BoardClient.plain_http`), so TLS and injected transports go through httpx.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Mapping
from urllib.parse import urlsplit

import numpy as np

_HEAD_MAX = 64 << 10  # a response head larger than this is not a plain answer


class _Thread(threading.local):
    sock: socket.socket | None = None
    buffer: np.ndarray | None = None


class PlainRanges:
    """Ranges of a board's blobs read by `recv_into` on one connection per thread. A
    returned view is valid until the same thread's next read."""

    def __init__(self, url: str, headers: Mapping[str, str], timeout: float) -> None:
        parts = urlsplit(url)
        self._address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._prefix = parts.path.rstrip("/")
        host = f"{self._address[0]}:{self._address[1]}"
        self._head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, **headers}.items())
        self._timeout = timeout
        self._local = _Thread()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()

    def read(self, path: str, start: int, end: int) -> memoryview | None:
        """Bytes [start, end) of the resource at `path`, or None when the answer is not a
        plain one (the caller then asks through its client). A kept connection that fails
        is tried once more on a new one: the board closes connections left idle (a thread
        that spent a while decoding a large tensor finds its connection gone)."""
        local = self._local
        for _ in range(2):
            kept = local.sock is not None
            body = self._ask(local, path, start, end)
            if body is not None or not kept:
                return body
        return None

    def _ask(self, local: _Thread, path: str, start: int, end: int) -> memoryview | None:
        try:
            if local.sock is None:
                local.sock = socket.create_connection(self._address, timeout=self._timeout)
                local.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._lock:
                    self._open.append(local.sock)
            line = f"GET {self._prefix}{path} HTTP/1.1\r\n"
            local.sock.sendall(f"{line}{self._head}Range: bytes={start}-{end - 1}\r\n\r\n".encode("latin-1"))
            body = self._receive(local, start, end)
        except OSError:
            body = None
        if body is None:
            self._drop(local)
        return body

    def _receive(self, local: _Thread, start: int, end: int) -> memoryview | None:
        """The body of a plain answer for [start, end), or None (the connection is then
        in an unknown state and is dropped)."""
        sock = local.sock
        assert sock is not None
        length = end - start
        if local.buffer is None or local.buffer.size < length + _HEAD_MAX:
            local.buffer = np.empty(length + _HEAD_MAX, dtype=np.uint8)
        view = local.buffer.data
        got = 0
        while (stop := bytes(view[: min(got, _HEAD_MAX)]).find(b"\r\n\r\n")) < 0:
            if got >= _HEAD_MAX:
                return None
            n = sock.recv_into(view[got:_HEAD_MAX])
            if not n:
                return None
            got += n
        lines = bytes(view[:stop]).decode("latin-1").split("\r\n")
        status = lines[0].split(" ", 2)
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        whole = status[1:2] == ["200"] and start == 0
        asked = f"bytes {start}-{end - 1}/"
        ranged = status[1:2] == ["206"] and fields.get("content-range", "").startswith(asked)
        if (
            not status[0].startswith("HTTP/1.")
            or not (whole or ranged)
            or fields.get("content-length") != str(length)
            or "transfer-encoding" in fields
            or fields.get("connection", "").lower() == "close"
        ):
            return None
        have = got - stop - 4
        if have > length:
            return None
        # the body's first bytes came with the head: move them to the front of the buffer
        view[:have] = view[stop + 4 : got]
        while have < length:
            n = sock.recv_into(view[have:length])
            if not n:
                return None
            have += n
        return view[:length]

    def _drop(self, local: _Thread) -> None:
        if local.sock is not None:
            with self._lock:
                if local.sock in self._open:
                    self._open.remove(local.sock)
            with contextlib.suppress(OSError):
                local.sock.close()
            local.sock = None

    def close(self) -> None:
        """Close every thread's connection (threads that read again open a new one)."""
        with self._lock:
            sockets, self._open = self._open, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
