"""Blob bytes from the page cache straight into the client's socket (`sendfile(2)`), for the
ASGI extension `http.response.zerocopysend`, which uvicorn does not implement itself.

A download read in chunks and written through the transport left all the kernel's socket
work (on loopback, the receiving side's too) on the event loop's thread, the one that
answers long-polls and commits: under `bench board --mixed` the downloads were most of
that thread's time (py-spy), and where the cores are shared a thread that is always busy
gets only its share of them, so wakes and commits queued behind download writes. Here the
kernel moves the bytes, in a process of its own at a lower CPU priority than the board
(`file_sender`); the loop only hands a send over and hears when it ended, and, mostly
idle, is scheduled as soon as a commit or a poll arrives.

The process reads and writes through its own copies of the file's and the socket's
descriptors, which it closes when done: a cancelled answer, which closes its file, does
not pull either away mid-send, nor lets a reused descriptor number send another file's
bytes. The transport writes nothing meanwhile (uvicorn's cycle writes nothing between the
head and the end of the body, and a pipelined request waits for the cycle before it).
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Any, cast

from uvicorn._types import ASGI3Application, ASGISendEvent
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from deltaboard.board.server.api.file_sender import FileSender
from deltaboard.board.server.api.server import JSONErrorsProtocol

ZEROCOPY = "http.response.zerocopysend"
# Headers still in the transport's buffer (a pipelined request behind a full socket) must
# leave before the body: how often to look whether they have.
FLUSH_POLL_S = 0.001


async def send_file(transport: asyncio.Transport, fd: int, offset: int, count: int) -> None:
    """Send `count` bytes of the open file `fd` from `offset` on the transport's socket,
    after what the transport holds, by the process's `FileSender`."""
    while transport.get_write_buffer_size() > 0:
        await asyncio.sleep(FLUSH_POLL_S)
    out = os.dup(transport.get_extra_info("socket").fileno())
    await file_sender().send(out, os.dup(fd), offset, count)


@functools.cache
def file_sender() -> FileSender:
    """The board's one sending process (`FileSender`)."""
    return FileSender()


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


class ZeroCopyProtocol(JSONErrorsProtocol):
    """uvicorn's HTTP protocol whose requests may send `http.response.zerocopysend`,
    announced in their scope's extensions. The hook is uvicorn's `_start_asgi_task`, which
    every request passes through before its task starts, so that the cycle sends through
    `ZeroCopyCycle` from its first message."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        cycle.scope.setdefault("extensions", {})[ZEROCOPY] = {}
        if type(cycle) is RequestResponseCycle:
            cycle.__class__ = ZeroCopyCycle
        super()._start_asgi_task(cycle, app)
