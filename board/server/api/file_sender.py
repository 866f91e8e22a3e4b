"""The board's side of the sending process (`send_process`): it starts the process, hands it
each download (the socket's and the file's descriptors, offset and count), and resolves the
download's future with the outcome the process reports.

The process starts with the first download and again after it ended (its sends in flight
then fail as a client gone would); it ends by itself when this side closes.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import sys

from deltaboard.board.server.api import send_process
from deltaboard.board.server.api.send_process import DONE, GONE, REPLY, REQUEST, STALLED

# The sending process's CPU priority below the board's (a nice value): where cores are
# scarce, the kernel's work for the downloads (on loopback, the receiving side's too) waits
# for the board's wakes and commits instead of competing with them.
SEND_NICE = 10
# A client that takes no byte for this long is cut off.
STALL_S = 60.0


class FileSender:
    """Downloads handed to one sending process, from one event loop."""

    def __init__(self, nice: int = SEND_NICE, stall_s: float = STALL_S) -> None:
        self.nice = nice
        self.stall_s = stall_s
        self.process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, asyncio.Future[None]] = {}
        self._ids = itertools.count()

    async def send(self, out: int, fd: int, offset: int, count: int) -> None:
        """Send `count` bytes of the open file `fd` from `offset` into the non-blocking
        socket `out`; both descriptors are this call's to close (the process holds its own
        copies). Raises `OSError` when the client went away, `TimeoutError` when it took
        nothing for `stall_s`, `EOFError` when the file ends early. Cancelled, the send
        still runs to its end in the process."""
        try:
            control = self._started()
            id = next(self._ids)
            future = self._pending[id] = asyncio.get_running_loop().create_future()
            await self._request(control, REQUEST.pack(id, offset, count), [out, fd])
        finally:
            os.close(out)
            os.close(fd)
        try:
            await future
        finally:
            self._pending.pop(id, None)

    def close(self) -> None:
        """End the process (it exits when its control socket closes) and fail what it held."""
        if self._control is not None and self._loop is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._control.fileno())
            self._control.close()
        self._control = self._loop = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the sending process ended"))
        self._pending.clear()
        if self.process is not None:
            self.process.wait()
            self.process = None

    def _started(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        if self._control is not None and self._loop is loop:
            return self._control
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            # -I: the standard library alone, not even the script's own folder on the path.
            argv = [send_process.__file__, str(theirs.fileno()), str(self.nice), str(self.stall_s)]
            self.process = subprocess.Popen([sys.executable, "-I", *argv], pass_fds=[theirs.fileno()])
        ours.setblocking(False)
        loop.add_reader(ours.fileno(), self._replies)
        self._control, self._loop = ours, loop
        return ours

    async def _request(self, control: socket.socket, message: bytes, fds: list[int]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                socket.send_fds(control, [message], fds)
                return
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(control.fileno(), writable.set_result, None)
                try:
                    await writable
                finally:
                    loop.remove_writer(control.fileno())

    def _replies(self) -> None:
        assert self._control is not None
        while True:
            try:
                message = self._control.recv(REPLY.size)
            except BlockingIOError:
                return
            except OSError:
                message = b""
            if not message:  # the process ended
                self.close()
                return
            id, outcome = REPLY.unpack(message)
            future = self._pending.pop(id, None)
            if future is None or future.done():
                continue
            if outcome == DONE:
                future.set_result(None)
            else:
                future.set_exception(outcome_error(outcome, self.stall_s))


def outcome_error(outcome: int, stall_s: float) -> Exception:
    if outcome == GONE:
        return ConnectionError("the client went away")
    if outcome == STALLED:
        return TimeoutError(f"the client took nothing for {stall_s:g}s")
    return EOFError("the file ended before the bytes promised")
