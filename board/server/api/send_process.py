"""The process that sends every download's bytes by `sendfile(2)`, at a lower CPU priority
than the board: `file_sender` starts it as a script (standard library only, none of the
board's imports) and hands it each download as two descriptors over a Unix socket.

A process, not a thread: every `sendfile` call gives the GIL up and takes it back, and a
sending thread in the board (one per download, and then one for all of them) made a
commit's sixty-odd store calls queue for the GIL behind it; at a lower CPU priority it was
also preempted while holding it, which stalled the event loop and the commit's thread with
it under `bench board --mixed` on a loaded machine. Here the board's threads share no lock
with the sending, and the kernel alone decides who runs.

One loop waits on all the downloads' sockets at once (`epoll`): a client that takes its
bytes slowly holds nothing but its entry, one that takes nothing for `stall_s` is given
up, and each send gets a turn of at most `TURN_BYTES` before the next. The process ends
when the board's end of the socket closes (the board stopped or died).

The wire, one datagram each way per send (`SOCK_SEQPACKET`): `REQUEST` (id, offset, count)
with the socket's and the file's descriptors; `REPLY` (id, outcome).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

REQUEST = struct.Struct("=QQQ")
REPLY = struct.Struct("=QB")
DONE, GONE, STALLED, SHORT = range(4)
# The most one `sendfile` call may send before the other downloads get their turn.
TURN_BYTES = 4 << 20
# How long the loop sleeps at most with nothing to send (a stalled client is noticed then).
IDLE_S = 1.0


@dataclass
class Send:
    """One download's bytes on their way: `count` bytes of `fd` from `offset` into `out`."""

    id: int
    out: int
    fd: int
    offset: int
    count: int
    progress: float = field(default_factory=time.monotonic)
    registered: bool = False


class Sender:
    def __init__(self, control: socket.socket, stall_s: float) -> None:
        self.control = control
        self.stall_s = stall_s
        self.epoll = select.epoll()
        self.epoll.register(control.fileno(), select.EPOLLIN)
        self.waiting: dict[int, Send] = {}
        self.ready: list[Send] = []

    def run(self) -> None:
        """Until the board's end closes."""
        self.control.setblocking(False)
        while True:
            for fd, _ in self.epoll.poll(0.0 if self.ready else IDLE_S):
                if fd == self.control.fileno():
                    if not self.take_new():
                        return
                elif (send := self.waiting.pop(fd, None)) is not None:
                    self.ready.append(send)
            ready, self.ready = self.ready, []
            for send in ready:
                self.step(send)
            self.give_up_stalled()

    def take_new(self) -> bool:
        """The sends the board asked for since; False once the board's end closed."""
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.control, REQUEST.size, 2)
            except BlockingIOError:
                return True
            if not message:
                return False
            id, offset, count = REQUEST.unpack(message)
            self.ready.append(Send(id, fds[0], fds[1], offset, count))

    def step(self, send: Send) -> None:
        """One `sendfile` call of the send; then it waits for its socket, takes its next
        turn, or ends."""
        if send.count == 0:
            self.end(send, DONE)
            return
        try:
            sent = os.sendfile(send.out, send.fd, send.offset, min(send.count, TURN_BYTES))
        except BlockingIOError:
            self.waiting[send.out] = send
            arm = self.epoll.modify if send.registered else self.epoll.register
            arm(send.out, select.EPOLLOUT | select.EPOLLONESHOT)
            send.registered = True
            return
        except OSError:
            self.end(send, GONE)
            return
        if sent == 0:
            self.end(send, SHORT)
            return
        send.offset += sent
        send.count -= sent
        send.progress = time.monotonic()
        if send.count == 0:
            self.end(send, DONE)
        else:
            self.ready.append(send)

    def give_up_stalled(self) -> None:
        now = time.monotonic()
        for out, send in list(self.waiting.items()):
            if now - send.progress >= self.stall_s:
                del self.waiting[out]
                self.end(send, STALLED)

    def end(self, send: Send, outcome: int) -> None:
        # The socket's other descriptor (the board's) keeps an epoll registration alive past
        # this close: it must go first, or it could fire later under a reused number.
        if send.registered:
            self.epoll.unregister(send.out)
        os.close(send.out)
        os.close(send.fd)
        self.control.setblocking(True)
        try:
            self.control.send(REPLY.pack(send.id, outcome))
        except OSError:  # the board is gone; the next read of the control socket ends the loop
            pass
        finally:
            self.control.setblocking(False)


def main(control_fd: int, nice: int, stall_s: float) -> None:
    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    Sender(socket.socket(fileno=control_fd), stall_s).run()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
