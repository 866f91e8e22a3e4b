"""The downloads' sending process (`board.server.api.file_sender`, `send_process`): a
file's range leaves whole through a socket that fills, several at once, after the caller
closed its own descriptors; a client that takes nothing is given up, one that left ends its
send, a file shorter than promised is an error; the process runs below the board's CPU
priority, and one that ended fails its sends in flight and is started again. Each check
waits for an outcome, never for a duration."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltaboard.board.server.api.file_sender import SEND_NICE, FileSender

BLOB = 8 * 2**20 + 17  # larger than a loopback socket's buffer: the sender must wait
STALL_S = 0.2


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(sender, receiver): the sender non-blocking with a small buffer, as a busy one is."""
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sender.setblocking(False)
    return sender, receiver


def receiving(sock: socket.socket, size: int) -> tuple[threading.Thread, bytearray]:
    """A thread reading up to `size` bytes from `sock` (or until it closes) into the array."""
    got = bytearray()

    def receive() -> None:
        while len(got) < size:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    thread = threading.Thread(target=receive)
    thread.start()
    return thread, got


@pytest.fixture
def sender() -> Iterator[FileSender]:
    sending = FileSender(stall_s=STALL_S)
    yield sending
    sending.close()


@pytest.fixture
def blob(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    data = os.urandom(BLOB)
    path = tmp_path / "blob"
    path.write_bytes(data)
    with open(path, "rb") as f:
        yield f.fileno(), data


def send(sender: FileSender, sock: socket.socket, fd: int, offset: int, count: int) -> None:
    asyncio.run(sender.send(os.dup(sock.fileno()), os.dup(fd), offset, count))


def test_ranges_leave_whole_through_full_sockets_at_once(blob):
    fd, data = blob
    sender = FileSender()
    pairs = [socket_pair() for _ in range(3)]
    readers = [receiving(receiver, BLOB - 10 * i) for i, (_, receiver) in enumerate(pairs)]

    async def all_at_once() -> None:
        await asyncio.gather(
            *(
                sender.send(os.dup(out.fileno()), os.dup(fd), 5 * i, BLOB - 10 * i)
                for i, (out, _) in enumerate(pairs)
            )
        )

    asyncio.run(all_at_once())
    sender.close()
    for i, (thread, got) in enumerate(readers):
        thread.join(60)
        assert bytes(got) == data[5 * i : BLOB - 5 * i]


def test_the_callers_descriptors_may_close_at_once(tmp_path, blob, sender):
    _, data = blob
    path = tmp_path / "blob"
    out, receiver = socket_pair()
    thread, got = receiving(receiver, BLOB)

    async def close_then_wait() -> None:
        with open(path, "rb") as f:
            sending = asyncio.ensure_future(sender.send(os.dup(out.fileno()), os.dup(f.fileno()), 0, BLOB))
        out.close()
        await sending

    asyncio.run(close_then_wait())
    thread.join(60)
    assert bytes(got) == data


def test_a_client_that_takes_nothing_is_given_up(blob, sender):
    fd, _ = blob
    out, _receiver = socket_pair()
    with pytest.raises(TimeoutError):
        send(sender, out, fd, 0, BLOB)


def test_a_client_gone_ends_the_send(blob, sender):
    fd, _ = blob
    out, receiver = socket_pair()
    receiver.close()
    with pytest.raises(OSError):
        send(sender, out, fd, 0, BLOB)


def test_a_file_shorter_than_promised_is_an_error(blob, sender):
    fd, _ = blob
    out, receiver = socket_pair()
    thread, _ = receiving(receiver, BLOB)
    with pytest.raises(EOFError):
        send(sender, out, fd, 0, BLOB + 1)
    out.close()
    thread.join(60)


def test_nothing_to_send_ends_at_once(blob, sender):
    fd, _ = blob
    out, _receiver = socket_pair()
    send(sender, out, fd, 0, 0)


def test_the_sending_process_yields_the_cpu_to_the_board(blob, sender):
    fd, _ = blob
    out, receiver = socket_pair()
    thread, _ = receiving(receiver, 1)
    send(sender, out, fd, 0, 1)
    thread.join(60)
    assert sender.process is not None
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, sender.process.pid) == min(19, own + SEND_NICE)


def test_a_sending_process_that_ends_fails_its_sends_and_another_starts(blob):
    fd, data = blob
    sender = FileSender(stall_s=3600)  # the stalled send below is never given up

    async def killed_midway() -> None:
        out, _receiver = socket_pair()
        sending = asyncio.ensure_future(sender.send(os.dup(out.fileno()), os.dup(fd), 0, BLOB))
        while sender.process is None:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the request is handed over
        os.kill(sender.process.pid, signal.SIGKILL)
        with pytest.raises(ConnectionError):
            await sending
        out, receiver = socket_pair()
        thread, got = receiving(receiver, BLOB)
        await sender.send(os.dup(out.fileno()), os.dup(fd), 0, BLOB)
        await asyncio.to_thread(thread.join, 60)
        assert bytes(got) == data

    try:
        asyncio.run(killed_midway())
    finally:
        sender.close()
