"""One thread that sends every download's bytes by `sendfile(2)`, at a lower CPU priority
than the event loop.

Each `sendfile` call gives the GIL up and must take it back, which a thread that runs
Python (the event loop, a commit's store work) is then made to hand over: a thread per
download (sixteen under `bench board --mixed`) made every commit's sixty-odd store calls
queue behind them for the GIL, and the board's own commit time rose several-fold. One
thread for all downloads waits on all their sockets at once (`epoll`) and is the only one
that competes; a client that takes its bytes slowly holds no thread, and one that takes
nothing for `stall_s` is given up.

A send owns its two descriptors (duplicates, of the file and of the socket), which this
thread closes when done: the caller may close its own meanwhile (a cancelled answer), and
a reused descriptor number must never send another file's bytes or reach another socket.
"""

from __future__ import annotations

import asyncio
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# The sending thread's CPU priority below the event loop's (a nice value): where cores are
# scarce, the kernel's work for the downloads (on loopback, the receiving side's too) waits
# for the loop's wakes and commits instead of competing with them.
SEND_NICE = 10
# A client that takes no byte for this long is cut off.
STALL_S = 60.0
# The most one `sendfile` call may send before the other downloads get their turn.
TURN_BYTES = 4 << 20
# How long the thread sleeps at most with nothing to send (a stalled client is noticed then).
IDLE_S = 1.0


@dataclass
class Send:
    """One download's bytes on their way: `count` bytes of `fd` from `offset` into `out`."""

    out: int
    fd: int
    offset: int
    count: int
    done: Callable[[BaseException | None], None]
    progress: float = field(default_factory=time.monotonic)
    registered: bool = False


class FileSender:
    """The sending thread, started with the first send. `send` is called from the event
    loop; everything else runs on the thread."""

    def __init__(self, nice: int = SEND_NICE, stall_s: float = STALL_S) -> None:
        self.nice = nice
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._new: list[Send] = []
        self._wake_out, self._wake_in = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._wake_out, select.EPOLLIN)
        self._waiting: dict[int, Send] = {}
        self._ready: list[Send] = []
        self._thread: threading.Thread | None = None

    async def send(self, out: int, fd: int, offset: int, count: int) -> None:
        """Send `count` bytes of the open file `fd` from `offset` into the non-blocking
        socket `out`, descriptors this sender now owns and closes. Raises `OSError` when
        the client went away, `TimeoutError` when it took nothing for `stall_s`, `EOFError`
        when the file ends early. Cancelled, the send still runs to its end on the thread."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if future.cancelled():
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        def done(error: BaseException | None) -> None:
            loop.call_soon_threadsafe(settle, error)

        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deltaboard-send", daemon=True)
                self._thread.start()
            self._new.append(Send(out, fd, offset, count, done))
        os.write(self._wake_in, b"\0")
        await future

    def _run(self) -> None:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + self.nice)
        while True:
            timeout = 0.0 if self._ready else IDLE_S
            for fd, _ in self._epoll.poll(timeout):
                if fd == self._wake_out:
                    self._take_new()
                elif (send := self._waiting.pop(fd, None)) is not None:
                    self._ready.append(send)
            ready, self._ready = self._ready, []
            for send in ready:
                self._step(send)
            self._give_up_stalled()

    def _take_new(self) -> None:
        try:
            while os.read(self._wake_out, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            new, self._new = self._new, []
        self._ready += new

    def _step(self, send: Send) -> None:
        """One `sendfile` call of the send; then it waits for its socket, takes its next
        turn, or ends."""
        if send.count == 0:
            self._end(send, None)
            return
        try:
            sent = os.sendfile(send.out, send.fd, send.offset, min(send.count, TURN_BYTES))
        except BlockingIOError:
            self._waiting[send.out] = send
            arm = self._epoll.modify if send.registered else self._epoll.register
            arm(send.out, select.EPOLLOUT | select.EPOLLONESHOT)
            send.registered = True
            return
        except OSError as error:
            self._end(send, error)
            return
        if sent == 0:
            self._end(send, EOFError(f"the file ended {send.count} bytes early"))
            return
        send.offset += sent
        send.count -= sent
        send.progress = time.monotonic()
        if send.count == 0:
            self._end(send, None)
        else:
            self._ready.append(send)

    def _give_up_stalled(self) -> None:
        now = time.monotonic()
        for out, send in list(self._waiting.items()):
            if now - send.progress >= self.stall_s:
                del self._waiting[out]
                self._end(send, TimeoutError(f"the client took nothing for {self.stall_s:g}s"))

    def _end(self, send: Send, error: BaseException | None) -> None:
        # The socket's other descriptor (the loop's) keeps its epoll registration alive past
        # this close: it must go first, or it could fire later under a reused number.
        if send.registered:
            self._epoll.unregister(send.out)
        os.close(send.out)
        os.close(send.fd)
        send.done(error)
