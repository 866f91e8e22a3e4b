"""HTTP serving helpers shared by the sidecar and the reference engine.

`listen` binds and listens before anything else happens: uvicorn runs an app's lifespan
(where the sidecar starts its version loop, which reloads the engine) before it binds
its own port, so a process that lets uvicorn bind would touch its engine and only then
find its port taken. Both `deltaboard sidecar` and `deltaboard engine` take their socket
from `listen` first and hand it to `uvicorn_server(app).run(sockets=[sock])`.

`BackgroundServer` runs an ASGI app the same way on a loopback port in a background
thread: the demo runs its sidecars in-process this way and the tests start real engines
and sidecars this way (a real socket and a real HTTP server, without paying a process
start and a torch import per server). `wait_disconnect` returns when a client goes away
and `unless_disconnected` runs work unless that happens first, which is how both servers
stop work nobody will read.

`settle_gc` tunes the garbage collector of a process that serves requests from now on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import socket
import threading
import time
from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` and listening (connections wait in its backlog until
    the server accepts them). A taken port raises OSError saying which."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


GC_YOUNG_THRESHOLD = 10_000
"""Allocations between two collections of the youngest generation (Python's default: 700)."""


def settle_gc() -> None:
    """Make the garbage collector cheap for this process, which has started and serves
    requests from now on. What startup made (modules, the app: tens of thousands of
    objects) leaves the collector's generations for good (`gc.freeze`), so that a full
    collection, which walked all of it and stalled the event loop, every request waiting,
    walks only what was made since; and the youngest generation is collected every
    `GC_YOUNG_THRESHOLD` allocations instead of every 700. A request's objects are freed
    by their reference counts as it ends (the sidecar's server cuts the cycles a request
    would leave, `services.sidecar.server`): the collections found nothing to free, and
    each request paid its share of them (figures in docs/design.md). Only for a process
    of its own (a sidecar's, a worker's): a frozen object is never collected, so a test
    process that started servers again and again would keep its garbage."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def uvicorn_server(app: Any) -> Any:
    """A uvicorn server for `app`, to be run on a socket from `listen`; the sidecar's app
    (`InferenceRoutes`) is served by the sidecar's own connection protocol
    (`services.sidecar.server`), any other by uvicorn's."""
    import uvicorn

    from deltaboard.services.sidecar.proxy import InferenceRoutes
    from deltaboard.services.sidecar.server import SidecarProtocol

    http: Any = functools.partial(SidecarProtocol, app=app) if isinstance(app, InferenceRoutes) else "auto"
    # No access log and no proxy headers: a line and a header pass per request that
    # neither server uses.
    config = uvicorn.Config(
        app,
        http=http,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=2,
        access_log=False,
        proxy_headers=False,
    )
    return uvicorn.Server(config)


class BackgroundServer:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = listen(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self._server = uvicorn_server(app)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=f"http-{self.port}", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def wait_disconnect(request: Request) -> None:
    """Return once the client disconnects (call only after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` unless the client disconnects first (then cancel it): (finished, result)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # abandoned either way
        await task
    return False, None
