"""The sidecar's version loop: watch the board's head, choose the next version, sync,
and swap each verified version into the engine.

Runs on its own thread. With an adapter that has the engine's in-place hooks (`hot`),
each next version goes into the engine's weights in place (`_hot_step`): the follower
fetches and decodes it against its served slot (`Follower.hot_patch`), the engine stages
the patch file while it generates, the gate stops admissions that the new version would
break, the engine swaps it in between two forward passes, and only then does the follower
write it to disk, as the copy a restarted engine loads (its commit hook only flips the
directory). A version that cannot go in place (a keyframe, a catch-up from a pruned base,
a patch larger than the engine stages, an engine that refuses it) is loaded from disk.

Without the hot path, the follower calls `commit_hook(version, swap)` once a version
is staged and verified; the hook stops admissions (draining in `quiesce` mode), pauses
the engine (`in_place`), lets the follower swap the directory, has the engine reload,
resumes, and publishes the new served version, with what the engine then reports it
holds (`EngineStamp`), to the gate. A reload that fails marks the node unhealthy
(requests get 503 after their wait) and is retried by the loop, as is a node whose
engine no longer holds what the sidecar loaded: restarted empty, or loaded by someone
else (seen by the proxy on a response, or by the loop's own check while idle).

What retrying cannot fix stops the loop for good (`fail`): the board refusing the token
(`Unauthorized`, `Forbidden`) and a run that does not exist (`UnknownRun`: at once when
it existed, after the sidecar's wait for it to appear otherwise). The node then refuses
every request with the reason, and `Sidecar.serve` exits with it. A damaged slot
(`CorruptBase`) is repaired (`Follower.repair`), then the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from deltaboard.board.contract.errors import AuthError, NotFound, UnknownRun
from deltaboard.clients.engines import CommitMode, EngineAdapter, EngineAdapterError, EngineStamp, HotRefused
from deltaboard.clients.follower.errors import CorruptBase, FollowerError
from deltaboard.clients.resident import HotPatch, ResidentError, write_patch
from deltaboard.services.sidecar.constraints import next_target
from deltaboard.services.sidecar.metrics import SidecarMetrics

log = logging.getLogger("deltaboard.sidecar")
# Retries of a failed turn (board away, engine still starting) back off up to this: one
# cheap call per node every few seconds, and a node back within seconds of its engine.
MAX_BACKOFF_S = 2.0
# Swaps kept for the status page.
RECENT_SWAPS = 20


class FollowerPort(Protocol):
    """What the sidecar needs of `clients.follower.Follower`."""

    @property
    def version(self) -> int | None: ...

    @property
    def model_dir(self) -> Path: ...

    def sync(self, version: int | None = None) -> int:
        """Reach `version` (or only send the fleet heartbeat when already there)."""
        ...

    def repair(self, version: int | None = None) -> object:
        """Re-hash the directory and rebuild what is damaged."""
        ...

    def hot_patch(self, target: int) -> HotPatch:
        """The verified changes from the served version to `target` (one delta)."""
        ...

    def close(self) -> None: ...


class GatePort(Protocol):
    """What the loop needs of the version gate: the `VersionGate` of one process, or
    `workers.FleetGate`, which drives the gates of several worker processes as one."""

    @property
    def served(self) -> int | None: ...

    @property
    def head(self) -> int | None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def engine(self) -> EngineStamp | None: ...

    @property
    def mode(self) -> CommitMode: ...

    def pins(self) -> list[tuple[int, int | None]]: ...

    def begin_swap(self, version: int) -> None: ...

    def end_swap(self, version: int | None, sync_s: float, loaded: EngineStamp | str) -> None: ...

    def stop(self, reason: str) -> None: ...

    def publish_head(self, head: int | None) -> None: ...


HeadWatch = Callable[[int | None, float], int | None]
"""`(after, wait_s) -> head`: the board's head, long-polling while it is not past `after`."""


class VersionSync:
    def __init__(
        self,
        gate: GatePort,
        adapter: EngineAdapter,
        metrics: SidecarMetrics,
        watch_head: HeadWatch,
        poll_s: float = 5.0,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.gate = gate
        self.adapter = adapter
        self.metrics = metrics
        self.watch_head = watch_head
        self.poll_s = poll_s
        self.on_fatal = on_fatal
        self.follower: FollowerPort | None = None
        self.last_error: str | None = None
        self.fatal: str | None = None  # why the loop stopped for good
        self.swaps: deque[dict[str, object]] = deque(maxlen=RECENT_SWAPS)  # the latest last
        self._in_engine: int | None = None  # a version swapped in place, whose disk copy follows

    def commit_hook(self, version: int, swap: Callable[[], None]) -> None:
        """Called by the follower with a verified, staged version."""
        if version == self._in_engine and self.gate.served == version:
            swap()  # the engine took it in place already: this is the disk copy catching up
            return
        self._swap_in(version, swap)

    def _swap_in(self, version: int, swap: Callable[[], None]) -> None:
        assert self.follower is not None
        started = time.monotonic()
        self.gate.begin_swap(version)
        served = self.gate.served
        mode = self.gate.mode  # every call of this swap is told the same mode
        loaded: EngineStamp | str = "the engine failed to load"
        try:
            self.adapter.pause(mode)
            try:
                swap()
                served = version
                loaded = self.adapter.reload(self.follower.model_dir, version, mode)
            finally:
                self.adapter.resume(mode)
        except EngineAdapterError as exc:
            loaded = f"the engine failed to load version {version}: {exc}"
            self.last_error = str(exc)
            self.metrics.swap_failures.inc()
            log.error("engine reload of version %s failed: %s", version, exc)
        finally:
            elapsed = time.monotonic() - started
            self.gate.end_swap(served, elapsed, loaded)
        if isinstance(loaded, EngineStamp):
            self.metrics.swaps.inc()
            self.metrics.swap_seconds.observe(elapsed)
            self.swaps.append({"version": version, "path": "reload", "pause_ms": None, "ready_s": elapsed})

    def _hot_step(self, follower: FollowerPort, version: int) -> bool:
        """Swap `version` (one delta after the served one) into the engine's weights in
        place, then bring the disk copy along. False, with the engine untouched: this
        version cannot go in place (a keyframe, too large to stage, refused by the engine);
        the caller loads it from disk instead."""
        started = time.monotonic()
        try:
            patch = follower.hot_patch(version)
        except (FollowerError, ResidentError) as exc:
            log.info("version %s cannot go in place (%s): reloading it from disk", version, exc)
            return False
        directory = follower.model_dir / ".deltaboard" / "hot"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{version}.patch"
        write_patch(patch, path)
        try:
            try:
                self.adapter.stage_patch(path, version)
            except HotRefused as exc:
                log.warning(
                    "the engine would not stage version %s (%s): reloading it from disk", version, exc
                )
                return False
            self.gate.begin_swap(version)
            served = self.gate.served
            loaded: EngineStamp | str = self.gate.engine or "the engine's load is unknown"
            pause_ms: float | None = None
            try:
                committed = self.adapter.commit_patch(version, self.gate.mode)
                served, loaded, pause_ms = version, committed.stamp, committed.pause_ms
                self._in_engine = version
            except HotRefused as exc:  # the engine kept what it served: a reload follows
                log.error("the engine refused version %s in place (%s): reloading it from disk", version, exc)
                self.metrics.swap_failures.inc()
            except EngineAdapterError as exc:  # what the engine holds is unknown now
                loaded = f"the engine failed to take version {version} in place: {exc}"
                self.last_error = str(exc)
                self.metrics.swap_failures.inc()
            finally:
                ready = time.monotonic() - started
                self.gate.end_swap(served, ready, loaded)
        finally:
            path.unlink(missing_ok=True)
        if served != version:
            return isinstance(loaded, str)  # unhealthy: the loop reloads; refused: reload now
        self.metrics.swaps.inc()
        self.metrics.swap_seconds.observe(ready)
        self.swaps.append({"version": version, "path": "hot", "pause_ms": pause_ms, "ready_s": ready})
        follower.sync(version)  # the disk copy, for restarts (the commit hook only swaps)
        return True

    def _reload_held(self) -> None:
        """Load what the follower holds into the engine (start-up, or after a failed reload)."""
        assert self.follower is not None
        version = self.follower.version
        if version is not None:
            self._swap_in(version, lambda: None)

    def run(self, follower: FollowerPort, stop: threading.Event) -> None:
        """Loop until `stop`; the loop owns `follower` and closes it on the way out."""
        self.follower = follower
        backoff = 0.5
        try:
            while not stop.is_set():
                try:
                    self._step(follower, stop)
                    backoff = 0.5
                except (AuthError, UnknownRun) as exc:  # retrying cannot fix these
                    self.fail(f"{type(exc).__name__}: {exc}")
                    return
                except CorruptBase as exc:
                    log.error("sync loop: %s: repairing", exc)
                    follower.repair()
                except Exception as exc:  # board, engine or integrity trouble: keep serving, retry
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("sync loop: %s", self.last_error)
                    stop.wait(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
        finally:
            follower.close()

    def fail(self, reason: str) -> None:
        """Stop for good: the node refuses every request with `reason`, and whoever serves
        it is told (`on_fatal`)."""
        self.fatal = self.last_error = reason
        log.info("the sidecar stops: %s", reason)
        self.gate.stop(reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _engine_holds_own_load(self) -> bool:
        """Whether the engine still holds the sidecar's last load. An engine that does not
        answer this time (busy, restarting) says nothing either way: the next idle turn
        asks again, and a restarted one answers with a stamp that differs."""
        try:
            return self.adapter.loaded() == self.gate.engine
        except EngineAdapterError as exc:
            log.warning("could not read what the engine holds (%s): checking again on the next turn", exc)
            return True

    def _step(self, follower: FollowerPort, stop: threading.Event) -> None:
        """One turn: load what the follower holds if the engine lacks it; else sync toward the
        next target; else wait for the head to move (heartbeating while idle)."""
        if not self.gate.healthy or self.gate.served != follower.version:
            self._reload_held()
            if not self.gate.healthy:
                raise EngineAdapterError(self.last_error or "engine reload failed")
            return
        target = next_target(self.gate.served, self.gate.head, self.gate.pins())
        if target is not None:
            served = self.gate.served
            hot = self.adapter.hot and served is not None and target > served
            if hot and served is not None and self._hot_step(follower, served + 1):
                return  # in place, one version at a time
            try:
                follower.sync(target)
            except NotFound as exc:
                # A pinned version the board no longer holds (retention) must not hold the
                # node back: follow the head; the gate then answers the pin 410 Gone.
                if target == self.gate.head:
                    raise
                log.warning("cannot stop at pinned version %s (%s): following the head", target, exc)
                follower.sync(self.gate.head)
            return
        head = self.watch_head(self.gate.head, self.poll_s)
        if stop.is_set():
            return
        if head == self.gate.head and follower.version is not None:
            follower.sync(follower.version)  # already there: only the fleet heartbeat
            if not self._engine_holds_own_load():  # restarted, or loaded by someone else
                self._reload_held()
        self.gate.publish_head(head)
