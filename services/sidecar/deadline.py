"""A time limit on a request's wait for the engine, at the cost of one timer.

Every request through the sidecar bounds its wait for the engine (`ProxySettings.
engine_timeout_s`: a whole answer, or a stream's head; a stream then lasts as long as its
client reads it). `asyncio.timeout` did it at ~7 µs of CPU per request on the sidecar's
loop (its state machine, and a timer moved twice: set, then cleared for a stream), about a
twentieth of a stream's start (figures in docs/design.md); `Deadline` sets one timer and
cancels it, as `asyncio.timeout` does on expiry: the task is cancelled, and the
cancellation comes out of the `with` block as `TimeoutError`. A cancellation that is not
the deadline's (the client went away) passes as it is.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Deadline:
    """`with Deadline(seconds):` around awaits of the current task; `clear()` lifts the
    limit for what is left of the block."""

    __slots__ = ("_cancelling", "_handle", "_task", "expired")

    def __init__(self, seconds: float) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Deadline bounds the awaits of a task")
        self._task = task
        self._cancelling = task.cancelling()  # cancellations asked before: not the deadline's
        self.expired = False
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            seconds, self._expire
        )

    def _expire(self) -> None:
        self.expired = True
        self._handle = None
        self._task.cancel()

    def clear(self) -> None:
        """No limit from now on."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def __enter__(self) -> Deadline:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.clear()
        if self.expired and self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise TimeoutError from exc
