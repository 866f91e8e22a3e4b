"""The board as `serve` runs it (`uvicorn_options`), in a thread of the test's process, with
everything it writes to its clients noted in order (`Recorder`): tests of what the board's
own protocol does (parked polls, downloads by `sendfile`) check orders and states, never
durations."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import uvicorn

from deltaboard.board.server.api.longpoll import LongPollFastPath, LongPollProtocol
from deltaboard.board.server.api.server import uvicorn_options
from deltaboard.board.server.api.state import BoardState
from deltaboard.board.server.settings import Settings
from tests.support.servers import wait_until

ADMIN, READ = "admin-token-parked", "read-token-parked"


class Recorder:
    """A transport that notes, in order across all connections, what the board writes."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


@dataclass
class InProcessBoard:
    url: str
    port: int
    server: uvicorn.Server
    state: BoardState
    writes: list[bytes]

    def waiting(self) -> float:
        return self.state.metrics.registry.get_sample_value("deltaboard_long_polls") or 0.0


@contextlib.contextmanager
def in_process_board(data_dir: Path) -> Iterator[InProcessBoard]:
    """The board as `serve` runs it (`uvicorn_options`), in a thread of this process, its
    protocol's transports recorded."""
    settings = Settings(data_dir=data_dir, tokens=f"admin:{ADMIN},read:{READ}")
    options = uvicorn_options(settings)
    writes: list[bytes] = []

    class Recording(LongPollProtocol):
        polls = options["http"].polls

        def connection_made(self, transport: Any) -> None:
            super().connection_made(cast(asyncio.Transport, Recorder(transport, writes)))

    options.update(http=Recording)
    del options["host"], options["port"]
    app: LongPollFastPath = options["app"]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(**options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "the in-process board", None, None)
        yield InProcessBoard(f"http://127.0.0.1:{port}", port, server, app.state, writes)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
