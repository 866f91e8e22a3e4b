"""Time as a dependency: the one clock of the board, injected into the service and the ledger.

Lease expiry, fleet heartbeats, blob touches (retention's grace period) and run creation
stamps read `now()`; durations read `monotonic()`. Production uses `SystemClock`; tests
hand `create_app(settings, clock=ManualClock())` and move time with `advance` instead of
sleeping:

    clock = ManualClock()
    app = create_app(settings, clock=clock)
    ...                      # a heartbeat is stamped clock.now()
    clock.advance(301)       # past fleet_ttl_s: the node drops out of the fleet
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock time, epoch seconds (stored in records, shared by replicas)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (durations only)."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told (thread-safe: the ledger reads it in worker threads)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self._now = now
        self._elapsed = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._elapsed

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._now += seconds
            self._elapsed += seconds
