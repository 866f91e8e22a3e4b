"""Blob bytes from the page cache straight into the client's socket (`sendfile(2)`), for the
ASGI extension `http.response.zerocopysend`, which uvicorn does not implement itself.

A download read in chunks and written through the transport copied every byte twice in
this process and left the kernel's socket work (on loopback, the receiving side's too) on
the event loop's thread, the one that answers long-polls and commits. Here the kernel moves
the bytes, on threads of the sender's own (`senders`) at a lower CPU priority than the
loop; the loop only starts a send and hears when it ended.

A thread writes the socket through a duplicate of its descriptor, which the thread closes
when done (a cancelled answer does not pull it away mid-call); the transport writes nothing
meanwhile (uvicorn's cycle writes nothing between the head and the end of the body).
"""

from __future__ import annotations

import asyncio
import functools
import os
import select
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

ZEROCOPY = "http.response.zerocopysend"
# Downloads sending at once, each on a thread that sleeps in the kernel (its own CPU time
# there, not the event loop's; the GIL only between calls); the others wait for a thread.
SEND_THREADS = 64
# The sending threads' CPU priority below the event loop's (a nice value): where cores are
# scarce, the kernel's work for the downloads (on loopback, the receiving side's too) waits
# for the loop's wakes and commits instead of competing with them.
SEND_NICE = 10
# A client that takes no byte for this long is cut off, so that it holds a thread no longer.
STALL_S = 60
# Headers still in the transport's buffer (a pipelined request behind a full socket) must
# leave before the body: how often to look whether they have.
FLUSH_POLL_S = 0.001


def send_blocking(out: int, fd: int, offset: int, count: int, stall_s: float = STALL_S) -> None:
    """`sendfile` until `count` bytes have left, waiting for the non-blocking socket `out`
    between calls; `OSError` when the client went away, `TimeoutError` when it took
    nothing for `stall_s`, `EOFError` when the file ends early. Closes `out`, a duplicate
    this call owns: the thread, not the loop, knows when it is done with it."""
    try:
        send_all(out, fd, offset, count, stall_s)
    finally:
        os.close(out)


def send_all(out: int, fd: int, offset: int, count: int, stall_s: float) -> None:
    writable = select.poll()
    writable.register(out, select.POLLOUT)
    while count > 0:
        try:
            sent = os.sendfile(out, fd, offset, count)
        except BlockingIOError:
            if not writable.poll(stall_s * 1000):
                raise TimeoutError(f"the client took nothing for {stall_s}s") from None
            continue
        if sent == 0:
            raise EOFError(f"the file ended {count} bytes early")
        offset += sent
        count -= sent


async def send_file(transport: asyncio.Transport, fd: int, offset: int, count: int) -> None:
    """Send `count` bytes of the open file `fd` from `offset` on the transport's socket,
    after what the transport holds (`send_blocking`, on one of the `senders`)."""
    while transport.get_write_buffer_size() > 0:
        await asyncio.sleep(FLUSH_POLL_S)
    out = os.dup(transport.get_extra_info("socket").fileno())
    await asyncio.get_running_loop().run_in_executor(senders(), send_blocking, out, fd, offset, count)


def yield_cpu() -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + SEND_NICE)


@functools.cache
def senders() -> ThreadPoolExecutor:
    """The sending threads, of their own: a pooled thread keeps its lowered priority."""
    return ThreadPoolExecutor(SEND_THREADS, thread_name_prefix="deltaboard-send", initializer=yield_cpu)


class ZeroCopyCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, plus `http.response.zerocopysend` messages
    (`file`, `offset`, `count`, `more_body`) for a response with a Content-Length."""

    async def send(self, message: ASGISendEvent) -> None:
        event = cast(dict[str, Any], message)
        if event["type"] != ZEROCOPY:
            await super().send(message)
            return
        if not self.response_started or self.response_complete or self.chunked_encoding is not False:
            raise RuntimeError(f"{ZEROCOPY} needs a started response with a Content-Length")
        if self.disconnected:
            return
        count = int(event.get("count", self.expected_content_length))
        if count > self.expected_content_length:
            raise RuntimeError("Response content longer than Content-Length")
        if self.scope["method"] != "HEAD":
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
