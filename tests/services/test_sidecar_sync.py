"""The sidecar's version loop, one turn at a time, against a follower with injected faults."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest

from deltaboard.board.contract.errors import BoardError
from deltaboard.clients.board_client import error_from
from deltaboard.clients.engines import CommitMode, EngineAdapter, EngineStamp
from deltaboard.clients.follower import CorruptBase, FollowerError
from deltaboard.clients.resident import HotPatch
from deltaboard.services.sidecar.constraints import VersionConstraint
from deltaboard.services.sidecar.gate import Admitted, Refused, VersionGate
from deltaboard.services.sidecar.metrics import SidecarMetrics
from deltaboard.services.sidecar.sync import VersionSync


class RecordingAdapter(EngineAdapter):
    kind = "recording"

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")
        self.calls: list[tuple[object, ...]] = []
        self.holds = EngineStamp(None, loads=0)

    def pause(self, mode: CommitMode) -> None:
        self.calls.append(("pause", mode))

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> EngineStamp:
        self.calls.append(("reload", version, mode))
        self.holds = EngineStamp(str(version), (self.holds.loads or 0) + 1)
        return self.holds

    def resume(self, mode: CommitMode) -> None:
        self.calls.append(("resume", mode))

    def loaded(self) -> EngineStamp:
        return self.holds


class FakeFollower:
    """Versions appear on request; those in `missing` answer as the board does for a pruned
    one; a `damaged` directory raises `CorruptBase` until repaired."""

    def __init__(self, sync: VersionSync, missing: dict[int, int]) -> None:
        self.version: int | None = None
        self.model_dir = Path("/nonexistent")
        self.synced: list[int] = []
        self.repaired = self.damaged = False
        self._sync = sync
        self._missing = missing

    def sync(self, version: int | None = None) -> int:
        assert version is not None, "the sidecar always names the version it wants"
        if self.damaged:
            raise CorruptBase("slot A is damaged", ["t"])
        if version in self._missing:
            raise error_from(self._missing[version], "UnknownVersion", f"version {version} is gone")
        if version != self.version:
            self._sync.commit_hook(version, lambda: setattr(self, "version", version))
        self.synced.append(version)
        return version

    def repair(self, version: int | None = None) -> object:
        self.repaired, self.damaged = True, False
        return {"A": ["t"]}

    def hot_patch(self, target: int) -> HotPatch:
        raise FollowerError("these tests drive the disk path")

    def close(self) -> None:
        pass


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop

    async def cancel_pending() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(cancel_pending(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def make(
    loop: asyncio.AbstractEventLoop,
    mode: CommitMode,
    missing: dict[int, int] | None = None,
    head: int = 5,
    watch: Callable[[int | None, float], int | None] | None = None,
) -> tuple[VersionGate, RecordingAdapter, VersionSync, FakeFollower]:
    gate = VersionGate(mode)
    gate.bind(loop)
    adapter = RecordingAdapter()
    sync = VersionSync(gate, adapter, SidecarMetrics(), watch or (lambda after, wait: head), poll_s=0.1)
    gate.publish_head(head)
    follower = FakeFollower(sync, missing or {})
    sync.follower = follower  # what run() does before its first turn
    return gate, adapter, sync, follower


def pin(loop: asyncio.AbstractEventLoop, gate: VersionGate, **constraint: int) -> Future[Admitted | Refused]:
    """Start a waiting request and return its future once the gate lists its pin."""
    future = asyncio.run_coroutine_threadsafe(gate.admit(VersionConstraint(**constraint), 30.0), loop)
    while not gate.pins():
        threading.Event().wait(0.01)
    return future


def test_the_node_stops_at_a_pinned_version_then_goes_on_to_the_head(loop):
    gate, adapter, sync, follower = make(loop, "in_place")
    waiting = pin(loop, gate, exact=2)
    sync._step(follower, threading.Event())
    admitted = waiting.result(5)
    assert follower.synced == [2] and isinstance(admitted, Admitted)
    assert adapter.calls == [("pause", "in_place"), ("reload", 2, "in_place"), ("resume", "in_place")]
    asyncio.run_coroutine_threadsafe(gate.release(admitted), loop).result()
    sync._step(follower, threading.Event())
    assert follower.synced == [2, 5] and gate.served == 5


def test_a_pruned_pin_does_not_hold_the_node_back_and_its_request_is_gone(loop):
    gate, _, sync, follower = make(loop, "quiesce", missing={1: 404})
    waiting = pin(loop, gate, exact=1)
    sync._step(follower, threading.Event())
    assert follower.synced == [5] and gate.served == 5
    refused = waiting.result(5)
    assert isinstance(refused, Refused) and refused.code == "WeightVersionGone"


def test_other_board_failures_are_retried_not_skipped(loop):
    gate, _, sync, follower = make(loop, "quiesce", missing={1: 503})
    pin(loop, gate, exact=1)
    with pytest.raises(BoardError):
        sync._step(follower, threading.Event())
    assert follower.synced == [] and gate.served is None


def test_an_engine_loaded_by_someone_else_is_loaded_again_while_idle(loop):
    gate, adapter, sync, follower = make(loop, "quiesce")
    sync._step(follower, threading.Event())
    assert gate.served == 5 and gate.engine == EngineStamp("5", 1)
    sync._step(follower, threading.Event())  # idle: the engine holds what the sidecar loaded
    assert [c[0] for c in adapter.calls] == ["pause", "reload", "resume"]
    adapter.holds = EngineStamp("5", 2)  # a reload the sidecar did not ask for, same label
    sync._step(follower, threading.Event())
    assert [c[0] for c in adapter.calls].count("reload") == 2 and gate.engine == EngineStamp("5", 3)


@pytest.mark.parametrize(("status", "code"), [(401, "Unauthorized"), (403, "Forbidden"), (404, "UnknownRun")])
def test_what_retrying_cannot_fix_stops_the_loop_with_its_reason(loop, status, code):
    stopped: list[str] = []

    def refused(after: int | None, wait: float) -> int | None:
        raise error_from(status, code, "refused by the board")

    gate, _, sync, follower = make(loop, "quiesce", watch=refused)
    sync.on_fatal = stopped.append
    sync._step(follower, threading.Event())  # serves the head first, then watches it
    sync.run(follower, threading.Event())  # returns instead of retrying forever
    assert sync.fatal is not None and code in sync.fatal and stopped == [sync.fatal]
    assert not gate.healthy and gate.problem == sync.fatal


def test_a_damaged_directory_is_repaired_and_the_loop_goes_on(loop):
    stop = threading.Event()

    def idle(after: int | None, wait: float) -> int:
        stop.set()  # the first idle turn ends the run
        return 5

    gate, _, sync, follower = make(loop, "quiesce", watch=idle)
    follower.damaged = True
    sync.run(follower, stop)
    assert follower.repaired and sync.fatal is None and gate.served == 5
