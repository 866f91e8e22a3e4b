"""A proxy that does nothing: the floor `bench sidecar` reads the sidecar against.

On a machine whose cores the engine and the load generator share with the sidecar, part
of what the sidecar adds (time to first token, requests per second) is not the sidecar's
work but the cost of any process in the path: the wake-ups of one more process per hop,
its socket reads and writes, the connections it opens. This proxy has only that: each
client connection gets a connection of its own to the engine, and the bytes pass both
ways as they come, unparsed (raw asyncio protocols on uvloop, as the sidecar runs). What
the sidecar adds beyond it is its own.

It has no flow control (the bench's clients read everything as it comes) and no error
handling beyond closing both sides: it is a yardstick, not a server to deploy.
"""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from typing import cast
from urllib.parse import urlsplit

import uvloop


class _Side(asyncio.Protocol):
    """One connection of a pair: what it receives is written to the other's transport
    (held until the other is connected), and its close closes the other."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.held: list[bytes] = []  # what came before the peer was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, without the class

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.held.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pair(self, peer: _Side) -> None:
        """`peer` is connected: each passes to the other from now on, and what came
        meanwhile goes first (the peer, just connected, has received nothing yet)."""
        self.peer = peer
        peer.peer = self
        if self.held and peer.transport is not None:
            peer.transport.write(b"".join(self.held))
        self.held = []


class _Client(_Side):
    """A client's connection: it opens its connection to the engine as it is accepted."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.host = host
        self.port = port
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, engine = await loop.create_connection(_Side, self.host, self.port)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.pair(engine)


async def _serve(engine_url: str, port: Connection) -> None:
    parts = urlsplit(engine_url)
    assert parts.hostname is not None and parts.port is not None
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Client(parts.hostname or "", parts.port or 0), "127.0.0.1", 0, backlog=4096
    )
    port.send(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


def passthrough_process(engine_url: str, port: Connection) -> None:
    """Entry point of the proxy's process: sends its port through `port`, then serves."""
    uvloop.run(_serve(engine_url, port))
