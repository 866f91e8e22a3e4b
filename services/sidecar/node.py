"""A rollout sidecar assembled: follower + engine adapter + version gate + proxy app.

`Sidecar(config).app` is the ASGI app (with the node's status page at `/ui`); its lifespan
starts the version loop on a thread (bound to the app's event loop) and stops it on
shutdown. `Sidecar.serve(host, port, workers)` (what `deltaboard sidecar` runs) with
several workers forks that many processes serving the app, and runs the version loop in
this one for all of them (`services.sidecar.workers`). It binds its port before the
lifespan or the loop starts, so that a sidecar that cannot listen exits before its loop
ever touches the engine, and returns (raising `SidecarFailed`) when the loop stops for
good. The demo and the tests run the app in-process with `BackgroundServer`, which binds
first too.

A run that does not exist yet is waited for, up to `run_wait_s` (the trainer creates it
with its first publish); a run that existed and is gone, or a token the board refuses,
stops the sidecar at once (`VersionSync.fail`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from deltaboard.board.contract.errors import UnknownRun
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.engines import CommitMode, EngineAdapter, make_adapter
from deltaboard.services.sidecar.background import listen, settle_gc, uvicorn_server
from deltaboard.services.sidecar.gate import VersionGate
from deltaboard.services.sidecar.metrics import SidecarMetrics
from deltaboard.services.sidecar.proxy import InferenceRoutes, ProxySettings, create_proxy_app
from deltaboard.services.sidecar.sync import VersionSync
from deltaboard.services.sidecar.ui import add_status_page
from deltaboard.services.sidecar.workers import FleetGate, Lifespan
from deltaboard.services.sidecar.workers import serve as serve_workers

SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SidecarConfig:
    board_url: str
    run: str
    directory: Path
    engine_url: str
    engine_kind: str = "reference"
    mode: CommitMode = "quiesce"
    token: str | None = None
    node_id: str = "node"
    default_wait_s: float = 30.0
    max_wait_s: float = 300.0
    poll_s: float = 5.0
    drain_timeout_s: float = 60.0
    run_wait_s: float = 600.0  # how long a run that does not exist yet is waited for
    abort_stale: bool = False  # a swap aborts the requests it would break (`VersionGate`)
    hot: bool = False  # the engine takes versions in place (`VersionSync._hot_step`)


class SidecarFailed(RuntimeError):
    """The sidecar stopped for good (its reason: a refused token, a run that is gone)."""


class Sidecar:
    def __init__(self, config: SidecarConfig, adapter: EngineAdapter | None = None) -> None:
        self.config = config
        self.metrics = SidecarMetrics()
        self.gate = VersionGate(config.mode, config.drain_timeout_s, config.abort_stale)
        self.adapter = adapter or make_adapter(config.engine_kind, config.engine_url, hot=config.hot)
        self.board = BoardClient(config.board_url, config.token)
        self.sync = VersionSync(
            self.gate, self.adapter, self.metrics, self._watch_head, config.poll_s, self._on_fatal
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._give_up_on_run = 0.0
        self._server: Any = None
        self.follower: Any = None
        self._from_owner: dict[str, Any] | None = None  # in a worker process: the owner's news
        self._settings = ProxySettings(config.engine_url, config.default_wait_s, config.max_wait_s)
        self.app = create_proxy_app(
            self.gate, self.adapter, self._settings, self.metrics, self.status, self._lifespan
        )
        add_status_page(self.app.app)  # /ui: this node's status page

    def serve(self, host: str, port: int, workers: int = 1) -> None:
        """Listen on `host:port` (OSError, before anything else, if it cannot), then serve
        until interrupted; raises `SidecarFailed` if the version loop stopped for good.
        With `workers` > 1, that many processes serve, and this one runs the version loop
        for all of them (`services.sidecar.workers`)."""
        sock = listen(host, port)
        if workers > 1:
            shared: dict[str, Any] = {}
            config = self.config
            serve_workers(
                sock,
                lambda gate, metrics, lifespan: self._worker_app(gate, metrics, lifespan, shared),
                self._own,
                workers,
                config.mode,
                self.metrics,
                config.drain_timeout_s,
                config.abort_stale,
                shared,
            )
        else:
            self._server = uvicorn_server(self.app)
            self._server.run(sockets=[sock])
        if self.sync.fatal is not None:
            raise SidecarFailed(f"the sidecar stopped: {self.sync.fatal}")

    def _worker_app(
        self, gate: VersionGate, metrics: SidecarMetrics, lifespan: Lifespan, shared: dict[str, Any]
    ) -> InferenceRoutes:
        """In a worker process (this sidecar forked): its proxy, around the worker's gate,
        counting into `metrics` (this sidecar's, forked); what only the owner knows comes
        in through `shared`."""
        self.gate = gate
        self.metrics = metrics
        self._from_owner = shared
        self.app = create_proxy_app(gate, self.adapter, self._settings, metrics, self.status, lifespan)
        add_status_page(self.app.app)
        return self.app

    def _own(self, fleet: FleetGate, stop: threading.Event) -> None:
        """In the owner process: the version loop, driving every worker's gate."""
        fleet.info = self._loop_status
        self.sync.gate = fleet
        self._stop = stop
        self._give_up_on_run = time.monotonic() + self.config.run_wait_s
        self.follower = self._make_follower()
        try:
            self.sync.run(self.follower, stop)
        finally:
            self.board.close()
            self.adapter.close()

    def _loop_status(self) -> dict[str, Any]:
        """What the status shows of the version loop (in a worker: as the owner last said)."""
        if self._from_owner is not None:
            return dict(self._from_owner)
        return {"last_error": self.sync.last_error, "swaps": list(self.sync.swaps)}

    def _on_fatal(self, reason: str) -> None:
        if self._server is not None:
            self._server.should_exit = True

    def _watch_head(self, after: int | None, wait_s: float) -> int | None:
        try:
            return self.board.head(self.config.run, after=-1 if after is None else after, wait=wait_s).version
        except UnknownRun:
            existed = after is not None or (self.follower is not None and self.follower.version is not None)
            if existed or time.monotonic() >= self._give_up_on_run:
                raise
            self._stop.wait(min(wait_s, 1.0))  # the trainer has not created the run yet
            return None

    def _make_follower(self) -> Any:
        from deltaboard.clients.follower import Follower

        return Follower(
            self.board,
            self.config.run,
            self.config.directory,
            node_id=self.config.node_id,
            engine=self.config.engine_kind,
            commit_hook=self.sync.commit_hook,
        )

    def status(self) -> dict[str, Any]:
        served, head = self.gate.served, self.gate.head
        return {
            "node_id": self.config.node_id,
            "run": self.config.run,
            "mode": self.gate.mode,
            "served": served,
            "head": head,
            "lag": head - served if head is not None and served is not None else None,
            "healthy": self.gate.healthy,
            "inflight": self.gate.inflight,
            "swapping": self.gate.swapping,
            "engine": None if self.gate.engine is None else asdict(self.gate.engine),
            "problem": self.gate.problem,
            "hot": self.adapter.hot,
            "last_error": None,
            "swaps": [],
            **self._loop_status(),
        }

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.gate.bind(asyncio.get_running_loop())
        self._give_up_on_run = time.monotonic() + self.config.run_wait_s
        self.follower = self._make_follower()
        self._thread = threading.Thread(
            target=self.sync.run,
            args=(self.follower, self._stop),
            name=f"sidecar-{self.config.node_id}",
            daemon=True,
        )
        self._thread.start()
        # served from a process's main thread (`serve`), the process is the sidecar's own:
        # settle its collector (`settle_gc`); not one that serves it from a thread of its
        # own (a test's, the demo's, through `BackgroundServer`)
        if threading.current_thread() is threading.main_thread():
            settle_gc()
        try:
            yield
        finally:
            self._stop.set()
            # A sync or swap in progress finishes; a head long-poll ends within poll_s.
            await asyncio.to_thread(self._thread.join, self.config.poll_s + SHUTDOWN_TIMEOUT_S)
            self.board.close()
            self.adapter.close()
