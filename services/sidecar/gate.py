"""The sidecar's version state: which version the engine serves, admission, and swaps.

Lives on the proxy's event loop. Requests are *admitted* (counted in flight) only when
their constraint holds and no swap is in progress; a swap stops admissions and is
entered from the follower's thread through `begin_swap` / `end_swap`. Before swapping,
`quiesce` drains every request in flight; `in_place` waits only for the requests whose
constraint does not accept the new version (an `exact` or `max` pin below it) and swaps
under the others. Because admission and the served version change under one lock, a
response's version range (served at admission, served at release) is exact: in `quiesce`
mode start == end; in `in_place` mode a swap may fall in between and the range says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from deltaboard.clients.engines import CommitMode
from deltaboard.services.sidecar.constraints import (
    Gone,
    Serve,
    SidecarCode,
    VersionConstraint,
    Wait,
    decide,
    retry_after_s,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Admitted:
    start: int | None
    waited_s: float
    high: int | None  # the highest version the request accepts: a swap past it waits for it


@dataclass(frozen=True)
class Refused:
    code: SidecarCode
    message: str
    required: dict[str, int | None]
    served: int | None
    head: int | None
    retry_after_s: int | None


class VersionGate:
    def __init__(self, mode: CommitMode, drain_timeout_s: float = 60.0) -> None:
        self.mode = mode
        self.drain_timeout_s = drain_timeout_s
        self.served: int | None = None
        self.head: int | None = None
        self.swapping = False
        self.inflight = 0
        self._bounded: Counter[int] = Counter()  # requests in flight by their highest version
        self.healthy = True
        self.sync_s = 1.0
        self.interval_s = 1.0
        self._head_at: float | None = None
        self._pins: dict[object, tuple[int, int | None]] = {}  # waiting request -> (low, high)
        self._cond = asyncio.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Remember the loop that owns this gate, so threads can call into it."""
        self._loop = loop

    def pins(self) -> list[tuple[int, int | None]]:
        """(low, high) of the requests waiting now; safe to read from any thread."""
        return list(self._pins.values())

    async def admit(self, constraint: VersionConstraint, wait_s: float) -> Admitted | Refused:
        """Admit the request once its constraint holds, or refuse it (at once, or after `wait_s`)."""
        started = time.monotonic()
        deadline = started + wait_s
        key = object()  # this request's identity in `_pins`
        async with self._cond:
            try:
                while True:
                    decision = decide(constraint, self.served, self.head)
                    if isinstance(decision, Gone):
                        gone = SidecarCode.WEIGHT_VERSION_GONE
                        return self._refuse(gone, decision.reason, constraint, None)
                    if isinstance(decision, Serve) and not self.swapping and self.healthy:
                        high = constraint.high()
                        self.inflight += 1
                        if high is not None:
                            self._bounded[high] += 1
                        return Admitted(self.served, time.monotonic() - started, high)
                    low = decision.low if isinstance(decision, Wait) else (self.served or 0)
                    self._pins[key] = (low, constraint.high())
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return self._not_ready(constraint, low)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._cond.wait(), remaining)
            finally:
                self._pins.pop(key, None)

    def _not_ready(self, constraint: VersionConstraint, low: int) -> Refused:
        retry = retry_after_s(low, self.served, self.head, self.sync_s, self.interval_s)
        if not self.healthy:
            message = "the engine failed to load"
            return self._refuse(SidecarCode.ENGINE_UNAVAILABLE, message, constraint, retry)
        needs = constraint.describe(self.head)
        message = f"this node serves {self.served}; the request needs {needs}"
        return self._refuse(SidecarCode.WEIGHT_VERSION_NOT_READY, message, constraint, retry)

    def _refuse(
        self, code: SidecarCode, message: str, constraint: VersionConstraint, retry: int | None
    ) -> Refused:
        required = constraint.describe(self.head)
        return Refused(code, message, required, self.served, self.head, retry)

    async def release(self, high: int | None) -> int | None:
        """A request (admitted with highest version `high`) finished: the version it ends with."""
        async with self._cond:
            self.inflight -= 1
            if high is not None:
                self._bounded[high] -= 1
                if not self._bounded[high]:
                    del self._bounded[high]
            self._cond.notify_all()
            return self.served

    async def set_head(self, head: int | None) -> None:
        async with self._cond:
            if head is not None and (self.head is None or head > self.head):
                now = time.monotonic()
                if self._head_at is not None and self.head is not None:
                    per_version = (now - self._head_at) / (head - self.head)
                    self.interval_s = 0.7 * self.interval_s + 0.3 * per_version
                self.head, self._head_at = head, now
                self._cond.notify_all()

    def holds_until_done(self, admitted: Admitted) -> bool:
        """Whether no swap can happen under this request (within the drain timeout)."""
        pinned = admitted.high is not None and admitted.start is not None and admitted.high <= admitted.start
        return self.mode == "quiesce" or pinned

    def _may_swap_to(self, version: int) -> bool:
        if self.mode == "quiesce":
            return self.inflight == 0
        return all(high >= version for high in self._bounded)

    async def _begin_swap(self, version: int) -> None:
        async with self._cond:
            self.swapping = True
            # Past the timeout, swap anyway: those responses' ranges will say start != end.
            with contextlib.suppress(TimeoutError):
                drained = self._cond.wait_for(lambda: self._may_swap_to(version))
                await asyncio.wait_for(drained, self.drain_timeout_s)

    async def _end_swap(self, version: int | None, healthy: bool, sync_s: float) -> None:
        async with self._cond:
            self.served = version
            self.healthy = healthy
            self.swapping = False
            self.sync_s = 0.7 * self.sync_s + 0.3 * sync_s
            self._cond.notify_all()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None, "gate is not bound to an event loop"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def begin_swap(self, version: int) -> None:
        """From the follower's thread: stop admissions and drain what `version` would break."""
        self._call(self._begin_swap(version))

    def end_swap(self, version: int | None, healthy: bool, sync_s: float) -> None:
        """From the follower's thread: the engine now serves `version` (or failed to load)."""
        self._call(self._end_swap(version, healthy, sync_s))

    def publish_head(self, head: int | None) -> None:
        """From the follower's thread: the board's head moved."""
        self._call(self.set_head(head))
