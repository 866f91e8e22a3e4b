"""The sidecar's version state: which version the engine serves, admission, and swaps.

Lives on the proxy's event loop. Requests are *admitted* (counted in flight) only when
their constraint holds and no swap is in progress; a swap stops admissions and is
entered from the follower's thread through `begin_swap` / `end_swap`. Before swapping,
`quiesce` drains every request in flight; `in_place` waits only for the requests whose
constraint does not accept the new version (an `exact` or `max` pin below it) and swaps
under the others. Because admission and the served version change under one lock, a
response's version range (served at admission, served at release) is exact: in `quiesce`
mode start == end; in `in_place` mode a swap may fall in between and the range says so.

With `abort_stale`, a swap does not wait for the requests the new version would break:
under the same lock that stops admissions it completes their `Admitted.stale` future with
the refusal they would get if they arrived now (410 `WeightVersionGone`), and then waits,
as before, until they are released. The proxy, racing its upstream work against that
future (`unless_stale`), stops passing bytes, closes the upstream request (the engine
stops generating) and only then releases; so the swap still happens only once nothing it
breaks is in flight, and no aborted request passes a token of the new version. The others
are untouched: `quiesce` drains them, `in_place` swaps under them.

The range is only as true as the engine is faithful to the sidecar's swaps: anyone who
can reach the engine's own port can load other weights into it. So the gate also keeps
the stamps of the sidecar's own loads (`EngineStamp`, as the adapter reported after each
reload), and the proxy has each response `vouch`ed for: the stamp the engine reports
with it (or right after it) must be one of the sidecar's own loads made since the
request was admitted, with no foreign load in between (a load counter that skips
numbers shows one). A response that is not vouched for is refused (`EngineChanged`), and
a stamp that differs from the last own load marks the node unhealthy, so that the
version loop loads the sidecar's version again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from deltaboard.clients.engines import CommitMode, EngineStamp
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
# Own loads remembered for vouching: a request is vouched for only by loads made since its
# admission, so this bounds the swaps one in_place request may span.
KEPT_LOADS = 64


@dataclass(frozen=True)
class Refused:
    code: SidecarCode
    message: str
    required: dict[str, int | None]
    served: int | None
    head: int | None
    retry_after_s: int | None

    def error(self) -> dict[str, Any]:
        """The error object of the answer: a refusal's JSON body, or a stream's last event."""
        return {
            "code": str(self.code),
            "message": self.message,
            "served": self.served,
            "required": self.required,
            "head": self.head,
            "retryable": self.code != SidecarCode.WEIGHT_VERSION_GONE,
        }


@dataclass(frozen=True, eq=False)  # one per request: compared and hashed by identity
class Admitted:
    start: int | None
    waited_s: float
    constraint: VersionConstraint
    load: int  # the serial of the sidecar's own engine load current at admission
    stale: asyncio.Future[Refused]  # completed when a swap aborts the request (`abort_stale`)
    # The highest version the request accepts: a swap past it waits for it, or aborts it.
    # Read a few times at each request's start: worked out once.
    high: int | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "high", self.constraint.high())


class Stale(Exception):
    """A swap aborted the request in flight (`abort_stale`); `refused` is its answer."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(refused.message)
        self.refused = refused


async def unless_stale(work: Awaitable[T], admitted: Admitted) -> T:
    """`work`'s result, unless a swap aborts the request first: then `work` is cancelled
    and `Stale` raised. Work that finished wins over an abort that came with it."""
    task = asyncio.ensure_future(work)
    either: set[asyncio.Future[Any]] = {task, admitted.stale}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        abandoned = not task.done()  # the abort came first, or whoever awaits us was cancelled
        if abandoned:
            task.cancel()
            # Wait without `await task`: cancelling us again (anyio's cancel scopes do, until
            # we return) would cancel the task again and cut its cleanup short, leaving the
            # upstream connection open and the engine generating for nobody.
            await asyncio.wait({task})
            with contextlib.suppress(asyncio.CancelledError, Exception):  # abandoned either way
                task.result()
    if abandoned:
        raise Stale(admitted.stale.result())
    return task.result()


class VersionGate:
    def __init__(self, mode: CommitMode, drain_timeout_s: float = 60.0, abort_stale: bool = False) -> None:
        self.mode = mode
        self.drain_timeout_s = drain_timeout_s
        self.abort_stale = abort_stale  # a swap aborts the requests it breaks, not waits for them
        self.served: int | None = None
        self.head: int | None = None
        self.swapping = False
        self.inflight = 0
        self._bounded: dict[Admitted, int] = {}  # requests in flight with a highest version -> it
        self.healthy = True
        self.problem: str | None = None  # why the node is not healthy
        self.engine: EngineStamp | None = None  # what the engine holds: the sidecar's last load
        self._loads: list[tuple[int, EngineStamp]] = []  # own loads since the last foreign one
        self._serial = 0
        self._reloading = False  # drained, the engine loading: it may report the new load early
        self.sync_s = 1.0
        self.interval_s = 1.0
        self._head_at: float | None = None
        self._pins: dict[object, tuple[int, int | None]] = {}  # waiting request -> (low, high)
        self._cond = asyncio.Condition()  # swaps and vouches wait on it
        self._change: asyncio.Future[None] | None = None  # admissions wait on it (`_announce`)
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Remember the loop that owns this gate, so threads can call into it."""
        self._loop = loop

    def pins(self) -> list[tuple[int, int | None]]:
        """(low, high) of the requests waiting now; safe to read from any thread."""
        return list(self._pins.values())

    def admit_now(self, constraint: VersionConstraint, waited_s: float = 0.0) -> Admitted | None:
        """Admit the request at once if its constraint holds now (None: ask `admit`).
        Synchronous, so atomic on the gate's loop like anything done under its lock."""
        if (
            self.swapping
            or not self.healthy
            or not isinstance(decide(constraint, self.served, self.head), Serve)
        ):
            return None
        stale: asyncio.Future[Refused] = asyncio.get_running_loop().create_future()
        admitted = Admitted(self.served, waited_s, constraint, self._serial, stale)
        self.inflight += 1
        high = admitted.high
        if high is not None:
            self._bounded[admitted] = high
        return admitted

    async def admit(self, constraint: VersionConstraint, wait_s: float) -> Admitted | Refused:
        """Admit the request once its constraint holds, or refuse it (at once, or after `wait_s`).
        A waiting request looks again at each change of the gate's state (`_announce`),
        without the lock: hundreds of waiters woken at the end of a swap would otherwise
        take the lock one by one, one turn of the event loop each, and the next swap
        behind them."""
        started = time.monotonic()
        deadline = started + wait_s
        key = object()  # this request's identity in `_pins`
        try:
            while True:
                decision = decide(constraint, self.served, self.head)
                if isinstance(decision, Gone):
                    gone = SidecarCode.WEIGHT_VERSION_GONE
                    return self._refuse(gone, decision.reason, constraint, None)
                admitted = self.admit_now(constraint, time.monotonic() - started)
                if admitted is not None:
                    return admitted
                low = decision.low if isinstance(decision, Wait) else (self.served or 0)
                self._pins[key] = (low, constraint.high())
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return self._not_ready(constraint, low)
                await asyncio.wait({self._next_change()}, timeout=remaining)
        finally:
            self._pins.pop(key, None)

    def _next_change(self) -> asyncio.Future[None]:
        """A future that `_announce` completes at the next change of the state."""
        if self._change is None or self._change.done():
            self._change = asyncio.get_running_loop().create_future()
        return self._change

    def _announce(self) -> None:
        """The state changed: wake every request waiting for its admission, and every
        swap or vouch waiting on the lock's condition."""
        if self._change is not None and not self._change.done():
            self._change.set_result(None)
        self._cond.notify_all()

    def _not_ready(self, constraint: VersionConstraint, low: int) -> Refused:
        retry = retry_after_s(low, self.served, self.head, self.sync_s, self.interval_s)
        if not self.healthy:
            message = self.problem or "the engine failed to load"
            return self._refuse(SidecarCode.ENGINE_UNAVAILABLE, message, constraint, retry)
        serves = "no version yet" if self.served is None else f"version {self.served}"
        message = f"this node serves {serves}; the request needs {constraint.words(self.head)}"
        return self._refuse(SidecarCode.WEIGHT_VERSION_NOT_READY, message, constraint, retry)

    def _refuse(
        self, code: SidecarCode, message: str, constraint: VersionConstraint, retry: int | None
    ) -> Refused:
        required = constraint.describe(self.head)
        return Refused(code, message, required, self.served, self.head, retry)

    async def release(self, admitted: Admitted) -> int | None:
        """The request admitted as `admitted` finished: the version it ends with. Only a
        swap waits for releases, so only then is anyone woken."""
        self.inflight -= 1
        self._bounded.pop(admitted, None)
        if self.swapping:
            async with self._cond:
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
                self._announce()

    def _record_load(self, stamp: EngineStamp) -> None:
        """The engine loaded what the sidecar asked for, and now reports `stamp`."""
        if not stamp.follows(self.engine):
            self._loads.clear()  # someone else loaded in between: vouch for no earlier admission
        self._serial += 1
        self._loads.append((self._serial, stamp))
        del self._loads[:-KEPT_LOADS]
        self.engine = stamp

    def _vouches(self, stamp: EngineStamp, admitted: Admitted) -> bool:
        for serial, own in reversed(self._loads):  # the newest first: usually the one
            if serial < admitted.load:
                return False
            if own == stamp:
                return True
        return False

    async def vouch(self, stamp: EngineStamp, admitted: Admitted) -> bool:
        """Whether a response of a request admitted as `admitted`, for which the engine
        reports `stamp`, was generated with weights this sidecar loaded (see the module
        docstring). A stamp other than the last own load marks the node unhealthy."""
        if self._vouches(stamp, admitted):  # the common case, decided without the lock
            return True
        async with self._cond:
            if not self._vouches(stamp, admitted) and self._reloading:
                # The engine may report the load of the swap in progress before `end_swap`.
                with contextlib.suppress(TimeoutError):
                    reloaded = self._cond.wait_for(lambda: not self._reloading)
                    await asyncio.wait_for(reloaded, self.drain_timeout_s)
            if self._vouches(stamp, admitted):
                return True
            if stamp != self.engine and self.healthy:
                self.healthy = False
                self.problem = (
                    f"the engine's weights changed under the sidecar: it reports {stamp}, "
                    f"the sidecar's last load was {self.engine}; loading the served version again"
                )
                self._announce()
            return False

    async def _stop(self, reason: str) -> None:
        async with self._cond:
            self.healthy = False
            self.problem = reason
            self._announce()

    def holds_until_done(self, admitted: Admitted) -> bool:
        """Whether no swap can happen under this request (within the drain timeout)."""
        pinned = admitted.high is not None and admitted.start is not None and admitted.high <= admitted.start
        return self.mode == "quiesce" or pinned

    def _may_swap_to(self, version: int) -> bool:
        if self.mode == "quiesce":
            return self.inflight == 0
        return all(high >= version for high in self._bounded.values())

    def _abort_below(self, version: int) -> None:
        """Answer every request in flight that `version` would break as if it came now."""
        for admitted, high in self._bounded.items():
            if high < version and not admitted.stale.done():
                message = (
                    f"this node swaps to version {version}, past {high}, and never goes back: "
                    "the request in flight was aborted"
                )
                gone = SidecarCode.WEIGHT_VERSION_GONE
                admitted.stale.set_result(self._refuse(gone, message, admitted.constraint, None))

    async def _begin_swap(self, version: int) -> None:
        async with self._cond:
            self.swapping = True
            if self.abort_stale:
                self._abort_below(version)  # then wait for them as for any: released, upstream closed
            # Past the timeout, swap anyway: those responses' ranges will say start != end.
            with contextlib.suppress(TimeoutError):
                drained = self._cond.wait_for(lambda: self._may_swap_to(version))
                await asyncio.wait_for(drained, self.drain_timeout_s)
            self._reloading = True

    async def _end_swap(self, version: int | None, sync_s: float, loaded: EngineStamp | str) -> None:
        async with self._cond:
            self.served = version
            self.healthy = isinstance(loaded, EngineStamp)
            if isinstance(loaded, EngineStamp):
                self._record_load(loaded)
                self.problem = None
            else:
                self.problem = loaded
            self.swapping = self._reloading = False
            self.sync_s = 0.7 * self.sync_s + 0.3 * sync_s
            self._announce()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None, "gate is not bound to an event loop"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def begin_swap(self, version: int) -> None:
        """From the follower's thread: stop admissions and drain (or, with `abort_stale`,
        abort) what `version` would break."""
        self._call(self._begin_swap(version))

    def end_swap(self, version: int | None, sync_s: float, loaded: EngineStamp | str) -> None:
        """From the follower's thread: the directory serves `version`, and the engine
        reported `loaded` after loading it, or failed to load it (`loaded` says why)."""
        self._call(self._end_swap(version, sync_s, loaded))

    def stop(self, reason: str) -> None:
        """From the follower's thread: the node stopped for good; refuse every request, say why."""
        self._call(self._stop(reason))

    def publish_head(self, head: int | None) -> None:
        """From the follower's thread: the board's head moved."""
        self._call(self.set_head(head))
