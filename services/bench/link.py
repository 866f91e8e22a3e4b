"""A rate-limited TCP proxy that emulates a network link of a given bandwidth.

The publish benchmark compares deltas with full checkpoints *across a link*: on loopback
both are CPU-bound and the comparison says nothing about the cross-region case the design
targets. The proxy paces bytes with one token bucket per direction shared by every
connection, like a single physical link would, so parallel uploads do not multiply the
bandwidth. It runs in its own process (`LinkProcess`) so that its pacing loop does not
compete with the publisher for the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import socket
import time
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as MpEvent

CHUNK_BYTES = 256 * 1024


class Pacer:
    """Serialises bytes onto a link of `bytes_per_s`: each chunk waits for its slot.

    A virtual clock (`_free_at`) is when the link finishes sending what was already
    admitted; a chunk of n bytes occupies it for n / rate seconds. Idle time is not
    banked, so a burst after a pause is not faster than the link.
    """

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError("link bandwidth must be positive")
        self.bytes_per_s = bytes_per_s
        self._free_at = time.monotonic()

    async def admit(self, n: int) -> None:
        now = time.monotonic()
        start = max(now, self._free_at)
        self._free_at = start + n / self.bytes_per_s
        delay = self._free_at - now
        if delay > 0:
            await asyncio.sleep(delay)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pacer: Pacer) -> None:
    try:
        while chunk := await reader.read(CHUNK_BYTES):
            await pacer.admit(len(chunk))
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve_link(
    listen_port: int,
    target_host: str,
    target_port: int,
    gbit_per_s: float,
    ready: MpEvent | None = None,
    stop: MpEvent | None = None,
) -> None:
    """Proxy 127.0.0.1:`listen_port` to the target at `gbit_per_s` in each direction."""
    rate = gbit_per_s * 1e9 / 8
    up, down = Pacer(rate), Pacer(rate)

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            target_r, target_w = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pump(client_r, target_w, up), _pump(target_r, client_w, down))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    if ready is not None:
        ready.set()
    async with server:
        while stop is None or not stop.is_set():
            await asyncio.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(port: int, host: str, target_port: int, gbit: float, ready: MpEvent, stop: MpEvent) -> None:
    asyncio.run(serve_link(port, host, target_port, gbit, ready, stop))


class LinkProcess:
    """The proxy in a child process: `with LinkProcess(url_port, 1.0) as link: link.url`."""

    def __init__(self, target_host: str, target_port: int, gbit_per_s: float) -> None:
        self.port = free_port()
        self.gbit_per_s = gbit_per_s
        ctx = multiprocessing.get_context("spawn")
        self._ready = ctx.Event()
        self._stop = ctx.Event()
        self._proc: BaseProcess = ctx.Process(
            target=_run,
            args=(self.port, target_host, target_port, gbit_per_s, self._ready, self._stop),
            daemon=True,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LinkProcess:
        self._proc.start()
        if not self._ready.wait(30):
            self._proc.kill()
            raise RuntimeError("link proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
