"""A rate-limited TCP proxy that emulates a network link of a given bandwidth.

The publish benchmark compares deltas with full checkpoints *across a link*: on loopback
both are CPU-bound and the comparison says nothing about the cross-region case the design
targets. The proxy paces bytes with one token bucket per direction shared by every
connection, like a single physical link would, so parallel uploads do not multiply the
bandwidth. It runs in its own process (`LinkProcess`, `python -m deltaboard.services.bench.link`)
so that its pacing loop does not compete with the publisher for the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time

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


async def serve_link(listen_port: int, target_host: str, target_port: int, gbit_per_s: float) -> None:
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
    async with server:
        await server.serve_forever()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LinkProcess:
    """The proxy in a child process: `with LinkProcess(host, port, 1.0) as link: link.url`."""

    def __init__(self, target_host: str, target_port: int, gbit_per_s: float) -> None:
        self.port = free_port()
        self.gbit_per_s = gbit_per_s
        self._args = [
            sys.executable,
            "-m",
            "deltaboard.services.bench.link",
            "--port",
            str(self.port),
            "--target-host",
            target_host,
            "--target-port",
            str(target_port),
            "--gbit",
            str(gbit_per_s),
        ]
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LinkProcess:
        self._proc = subprocess.Popen(self._args)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError("the link proxy did not start")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description="Rate-limited TCP proxy emulating a link.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target-host", default="127.0.0.1")
    parser.add_argument("--target-port", type=int, required=True)
    parser.add_argument("--gbit", type=float, required=True)
    args = parser.parse_args()
    asyncio.run(serve_link(args.port, args.target_host, args.target_port, args.gbit))


if __name__ == "__main__":
    main()
