"""Several sidecar processes on one port, with one version gate state for all of them.

One core of proxying is not always enough beside a fast engine (figures in
docs/design.md), so `deltaboard sidecar --workers N` forks N worker processes that
accept on the same listening socket (bound once, before the fork: the kernel hands each
connection to one worker). Each worker runs the proxy with its own `VersionGate`, and
nothing but its own requests go through it: admission, the requests in flight, the
drain before a swap, the stale aborts and the vouching stay per process, on its event
loop, as with one process.

The version loop runs once, in the **owner** process (the one that forked the workers;
it serves no requests). It drives every worker's gate through `FleetGate`, which the
loop takes for its gate: each of its commands (`begin_swap`, `end_swap`,
`publish_head`, `stop`) goes to every worker over a pipe and returns only once every
worker has done it. So a swap is atomic for the fleet of workers exactly as it is for
one gate: the engine is touched only after every worker has stopped admitting and
drained (or aborted) what the new version breaks, and a worker admits again only with
the new version and the engine's new stamp recorded (a worker that has it already while
another still waits serves the same engine that loaded it). What a worker learns on its
own is asked for when the loop needs it: its waiting requests' pins (`pins`, the union
over the workers) and whether a response showed weights the sidecar did not load
(`healthy`: false if any worker says so).

`/metrics` is the fleet's, whichever worker a scrape reaches: the worker asks the owner,
which asks every worker for its share (per-request counts, requests in flight) and renders
the sums with its own swap series (`SidecarMetrics.exposition`), over pipes of their own,
so a scrape does not wait behind a swap's drain. Each worker answers `/healthz` and
`/sidecar/status` for itself: its gate and its requests in flight; what only the owner
knows (the loop's last error and its recent swaps) rides along with each command
(`FleetGate.info`). A worker that dies
ends the sidecar (the owner stops the others and returns), as does the loop stopping for
good; a worker whose owner is gone exits, and on Linux the kernel kills it when the owner
dies (`PR_SET_PDEATHSIG`), so that even a worker whose loop is stuck does not outlive a
killed owner, holding the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from deltaboard.clients.engines import CommitMode, EngineStamp
from deltaboard.services.sidecar.background import settle_gc, uvicorn_server
from deltaboard.services.sidecar.gate import VersionGate
from deltaboard.services.sidecar.metrics import SidecarMetrics

Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]
BuildApp = Callable[[VersionGate, SidecarMetrics, Lifespan], Any]
"""`(gate, metrics, lifespan) -> ASGI app`: a worker's proxy around its gate, counting
into `metrics` (whose `/metrics` is the fleet's), run with `lifespan`."""
Own = Callable[["FleetGate", threading.Event], None]
"""What the owner runs until the event is set: the version loop, driving the fleet's gate."""
STOP_TIMEOUT_S = 30.0
AUTO = "auto"
"""`deltaboard sidecar --workers auto` (the default): `auto_workers()`."""


def auto_workers() -> int:
    """How many workers `--workers auto` runs: 2 where this process may use two cores or
    more, else 1. A second worker splits each burst of stream starts between two event
    loops, which shortens the time the sidecar adds to a first token, for some more CPU
    per streamed token (each worker's reads bring fewer tokens); more than two was not
    measured (docs/design.md)."""
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 1


@dataclass(frozen=True)
class WorkerState:
    """What a worker's gate holds, as it answers each command."""

    served: int | None
    head: int | None
    swapping: bool  # admitting nothing: a swap is in progress
    healthy: bool
    problem: str | None
    engine: EngineStamp | None
    pins: list[tuple[int, int | None]]


class FleetGate:
    """The version gate of every worker, as the owner's version loop drives it (the part
    of `VersionGate` that `VersionSync` uses). Called from one thread, the loop's."""

    def __init__(self, conns: list[Connection], mode: CommitMode) -> None:
        self._conns = conns
        self.mode = mode
        self.info: Callable[[], dict[str, Any]] = dict  # what workers show of the loop
        self._states: list[WorkerState] = self._all("state")

    def _all(self, op: str, *args: Any) -> list[WorkerState]:
        """Do `op` in every worker's gate (all at once), and return once all did."""
        info = self.info()
        for conn in self._conns:
            conn.send((op, args, info))
        self._states = [conn.recv() for conn in self._conns]
        return self._states

    @property
    def served(self) -> int | None:
        return self._states[0].served

    @property
    def head(self) -> int | None:
        return self._states[0].head

    @property
    def engine(self) -> EngineStamp | None:
        return self._states[0].engine

    def states(self) -> list[WorkerState]:
        """Every worker's gate, as it is now."""
        return self._all("state")

    @property
    def healthy(self) -> bool:
        return all(state.healthy for state in self.states())

    @property
    def problem(self) -> str | None:
        return next((s.problem for s in self.states() if s.problem is not None), None)

    def pins(self) -> list[tuple[int, int | None]]:
        return [pin for state in self.states() for pin in state.pins]

    def begin_swap(self, version: int) -> None:
        self._all("begin_swap", version)

    def end_swap(self, version: int | None, sync_s: float, loaded: EngineStamp | str) -> None:
        self._all("end_swap", version, sync_s, loaded)

    def stop(self, reason: str) -> None:
        self._all("stop", reason)

    def publish_head(self, head: int | None) -> None:
        self._all("publish_head", head)


def _state(gate: VersionGate) -> WorkerState:
    return WorkerState(
        gate.served, gate.head, gate.swapping, gate.healthy, gate.problem, gate.engine, gate.pins()
    )


def _obey(
    gate: VersionGate, conn: Connection, bound: threading.Event, server: Any, info: dict[str, Any]
) -> None:
    """A worker's control thread: apply the owner's commands to this worker's gate."""
    bound.wait()
    commands: dict[str, Callable[..., None]] = {
        "begin_swap": gate.begin_swap,
        "end_swap": gate.end_swap,
        "stop": gate.stop,
        "publish_head": gate.publish_head,
        "state": lambda: None,
    }
    try:
        while True:
            op, args, shared = conn.recv()
            info.update(shared)
            commands[op](*args)
            conn.send(_state(gate))
    except (EOFError, OSError):  # the owner is gone: so is this worker
        server.should_exit = True


def _share(gate: VersionGate, metrics: SidecarMetrics, conn: Connection) -> None:
    """A worker's metrics thread: its share of the fleet's metrics, each time the owner asks."""
    try:
        while True:
            conn.recv()
            conn.send(metrics.share(gate.inflight))
    except (EOFError, OSError):  # the owner is gone: `_obey` ends this worker
        pass


def _asking(conn: Connection) -> Callable[[], bytes]:
    """A worker's `SidecarMetrics.fleet`: the fleet's metrics, asked of the owner (one
    scrape at a time per worker; each is one message each way)."""
    lock = threading.Lock()

    def ask() -> bytes:
        with lock:
            conn.send(None)
            return conn.recv_bytes()

    return ask


def _totals(
    asks: list[Connection], shares: list[Connection], metrics: SidecarMetrics, fleet: FleetGate
) -> None:
    """The owner's metrics thread: a worker's scrape (on `asks`) is answered with the
    fleet's metrics, every worker's share (asked on `shares`, all at once) added to the
    owner's own series. Ends with the first worker gone: so is the fleet (`serve`)."""
    try:
        while True:
            for conn in wait(asks):
                cast(Connection, conn).recv()
                for share in shares:
                    share.send(None)
                parts = [share.recv() for share in shares]
                cast(Connection, conn).send_bytes(metrics.exposition(fleet.served, fleet.head, 0, parts))
    except (EOFError, OSError):
        pass


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with(owner: int) -> None:
    """Linux: SIGKILL for this process when its owner ends (its exit is otherwise seen by
    the worker's own loop, which a stuck loop never sees); at once if the owner ended
    before the request took effect."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != owner:
        os._exit(1)


def _work(
    owner: int,
    sock: socket.socket,
    build: BuildApp,
    conns: tuple[Connection, Connection, Connection],
    owners: list[Connection],
    mode: CommitMode,
    drain_timeout_s: float,
    abort_stale: bool,
    info: dict[str, Any],
    metrics: SidecarMetrics,
) -> None:
    _die_with(owner)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the owner's: uvicorn sets its own
    for inherited in owners:  # the owner's ends: only the owner may hold them, so that
        inherited.close()  # its exit reaches this worker as the end of its pipe
    conn, ask, share = conns
    gate = VersionGate(mode, drain_timeout_s, abort_stale)
    metrics.fleet = _asking(ask)
    bound = threading.Event()

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        gate.bind(asyncio.get_running_loop())
        bound.set()
        settle_gc()  # started: what follows is serving
        yield

    server = uvicorn_server(build(gate, metrics, lifespan))
    threading.Thread(target=_obey, args=(gate, conn, bound, server, info), daemon=True).start()
    threading.Thread(target=_share, args=(gate, metrics, share), daemon=True).start()
    server.run(sockets=[sock])


class _Terminated(BaseException):
    """SIGTERM in the owner: the workers are stopped, then the signal is raised again, so
    the sidecar's exit says it was terminated, as uvicorn's does for one process."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated


def serve(
    sock: socket.socket,
    build: BuildApp,
    own: Own,
    workers: int,
    mode: CommitMode,
    metrics: SidecarMetrics,
    drain_timeout_s: float = 60.0,
    abort_stale: bool = False,
    info: dict[str, Any] | None = None,
) -> None:
    """Fork `workers` processes serving `build`'s app on `sock`, run `own` with their
    `FleetGate`, and return once `own` returns, a worker dies, or on Ctrl-C (the workers
    are stopped). `metrics` is the owner's (what `own` records: swaps) and, forked, each
    worker's; a scrape of any worker reads the fleet's. `info` is the dict a worker's
    status reads the owner's `FleetGate.info` into (forked with the worker)."""
    context = multiprocessing.get_context("fork")  # the app's builder is a closure
    if threading.current_thread() is threading.main_thread():  # where signals are handled
        signal.signal(signal.SIGTERM, _terminate)  # stop the workers on the way out, as on Ctrl-C
    conns: list[Connection] = []  # commands, one per worker
    asks: list[Connection] = []  # the workers' scrapes
    shares: list[Connection] = []  # the owner's questions for each worker's share
    processes = []
    stop = threading.Event()
    loop: threading.Thread | None = None
    terminated = False
    try:
        for i in range(workers):
            pipes = [context.Pipe() for _ in range(3)]
            mine = [ours for ours, _ in pipes]
            conns.append(mine[0])
            asks.append(mine[1])
            shares.append(mine[2])
            theirs = tuple(end for _, end in pipes)
            shared = info if info is not None else {}
            owned = [*conns, *asks, *shares]
            args = (
                os.getpid(),
                sock,
                build,
                theirs,
                owned,
                mode,
                drain_timeout_s,
                abort_stale,
                shared,
                metrics,
            )
            process = context.Process(target=_work, args=args, name=f"sidecar-worker-{i}", daemon=True)
            process.start()
            for end in theirs:
                end.close()
            processes.append(process)
        sock.close()  # the workers hold it
        fleet = FleetGate(conns, mode)
        totals = threading.Thread(target=_totals, args=(asks, shares, metrics, fleet), daemon=True)
        totals.start()
        loop = threading.Thread(target=own, args=(fleet, stop), name="sidecar-owner", daemon=True)
        loop.start()
        while loop.is_alive() and all(p.is_alive() for p in processes):
            wait([p.sentinel for p in processes], timeout=0.5)
    except _Terminated:
        terminated = True
    finally:
        stop.set()
        for process in processes:
            process.terminate()  # uvicorn shuts down gracefully on SIGTERM
        for process in processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
        if loop is not None:
            loop.join(STOP_TIMEOUT_S)  # a swap in progress finishes; a long-poll ends
        for conn in (*conns, *asks, *shares):
            with contextlib.suppress(OSError):
                conn.close()
    if terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
