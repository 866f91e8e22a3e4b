"""Blob bytes from the page cache straight into the client's socket (`sendfile(2)`), for the
ASGI extension `http.response.zerocopysend`, which uvicorn does not implement itself.

A download read in chunks and written through the transport copied every byte twice in
this process (file into a buffer on a worker thread, buffer into the socket on the event
loop), and each chunk took the GIL back from the loop: downloads delayed long-poll wakes
and commits (`bench board --mixed`, docs/design.md "Load"). With `sendfile` the kernel
moves the bytes; the event loop only asks it to, once per socket buffer's worth.

The socket is written through a duplicate of its descriptor: uvloop will not watch the
transport's own descriptor for us, and the transport must not write meanwhile (uvicorn's
cycle writes nothing between the headers and the end of the body). The duplicate is
unwatched before it is closed, so the loop never keeps a stale registration.
"""

from __future__ import annotations

import asyncio
import functools
import os
import select
from typing import Any, cast

import anyio
import anyio.to_thread
from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

ZEROCOPY = "http.response.zerocopysend"
# Downloads sending at once, each on a thread that sleeps in the kernel (its own CPU time
# there, not the event loop's; the GIL only between calls); the others wait for a thread.
SEND_THREADS = 64
# A client that takes no byte for this long is cut off, so that it holds a thread no longer.
STALL_S = 60
# Headers still in the transport's buffer (a pipelined request behind a full socket) must
# leave before the body: how often to look whether they have.
FLUSH_POLL_S = 0.001


def send_blocking(out: int, fd: int, offset: int, count: int) -> None:
    """`sendfile` until `count` bytes have left, waiting for the non-blocking socket `out`
    between calls; `OSError` when the client went away, `TimeoutError` when it took
    nothing for `STALL_S`, `EOFError` when the file ends early."""
    writable = select.poll()
    writable.register(out, select.POLLOUT)
    while count > 0:
        try:
            sent = os.sendfile(out, fd, offset, count)
        except BlockingIOError:
            if not writable.poll(STALL_S * 1000):
                raise TimeoutError(f"the client took nothing for {STALL_S}s") from None
            continue
        if sent == 0:
            raise EOFError(f"the file ended {count} bytes early")
        offset += sent
        count -= sent


async def send_file(transport: asyncio.Transport, fd: int, offset: int, count: int) -> None:
    """Send `count` bytes of the open file `fd` from `offset` on the transport's socket,
    after what the transport holds (`send_blocking`, on one of `SEND_THREADS`)."""
    while transport.get_write_buffer_size() > 0:
        await asyncio.sleep(FLUSH_POLL_S)
    out = os.dup(transport.get_extra_info("socket").fileno())
    try:
        await anyio.to_thread.run_sync(send_blocking, out, fd, offset, count, limiter=send_threads())
    finally:
        os.close(out)


@functools.cache
def send_threads() -> anyio.CapacityLimiter:
    return anyio.CapacityLimiter(SEND_THREADS)


class HeldHead:
    """The cycle's view of its transport: the response head that uvicorn writes is held
    and leaves with the first body bytes, in one write (one segment, one system call on
    each side) instead of two; a thousand long-poll answers a second pay for each. (Every
    response of the board sends its first body bytes at once, an event stream its first
    event included.)"""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.head = b""
        self.holding = True

    def write(self, data: bytes) -> None:
        if self.holding:
            self.head += data
            return
        if self.head:
            data, self.head = self.head + data, b""
        if data and not self.transport.is_closing():
            self.transport.write(data)

    def flush(self) -> None:
        self.holding = False
        self.write(b"")

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class ZeroCopyCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, plus `http.response.zerocopysend` messages
    (`file`, `offset`, `count`, `more_body`) for a response with a Content-Length, and the
    response head sent with the first body bytes (`HeldHead`)."""

    async def send(self, message: ASGISendEvent) -> None:
        event = cast(dict[str, Any], message)
        if event["type"] == "http.response.start" and not self.response_started:
            held = HeldHead(self.transport)
            self.transport = cast(asyncio.Transport, held)
            await super().send(message)
            held.holding = False
            return
        if event["type"] != ZEROCOPY:
            await super().send(message)
            if isinstance(self.transport, HeldHead):  # a head uvicorn sends no body after (HEAD)
                self.transport.flush()
            return
        if not self.response_started or self.response_complete or self.chunked_encoding is not False:
            raise RuntimeError(f"{ZEROCOPY} needs a started response with a Content-Length")
        if self.disconnected:
            return
        count = int(event.get("count", self.expected_content_length))
        if count > self.expected_content_length:
            raise RuntimeError("Response content longer than Content-Length")
        if self.scope["method"] != "HEAD":
            cast(HeldHead, self.transport).flush()
            try:
                await send_file(self.transport, event["file"].fileno(), int(event.get("offset") or 0), count)
            except OSError:  # the client went away: as uvicorn does when it notices
                self.disconnected = True
                self.transport.close()
                return
            self.expected_content_length -= count
        await super().send(
            {"type": "http.response.body", "body": b"", "more_body": event.get("more_body", False)}
        )
