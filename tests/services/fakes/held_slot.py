"""A reference engine's weight slot that holds each request after its first k tokens.

The engine runs one forward pass per token through `WeightSlot.step`, each request with
its own `cancel` event; this slot stops every request before its (k+1)-th forward pass
until the test lets it go. So a swap made while they are held lands after exactly k
tokens of each, whatever the speed of the machine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from deltaboard.services.engine.runtime import LoadedModel, WeightSlot


class HeldSlot(WeightSlot):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self._steps: dict[threading.Event, int] = {}  # forward passes begun, by request
        self._held = threading.Condition()
        self._waiting = 0
        self._open = False

    @contextmanager
    def step(self, cancel: threading.Event) -> Iterator[LoadedModel]:
        with self._held:
            begun = self._steps.get(cancel, 0)
            self._steps[cancel] = begun + 1
            if begun == self.after and not self._open:
                self._waiting += 1
                self._held.notify_all()
                self._held.wait_for(lambda: self._open)
        with super().step(cancel) as loaded:
            yield loaded

    def wait_held(self, requests: int, timeout_s: float = 60.0) -> None:
        """Return once `requests` requests are held after their k tokens."""
        with self._held:
            if not self._held.wait_for(lambda: self._waiting >= requests, timeout_s):
                raise AssertionError(f"{requests} requests never reached token {self.after}")

    def go(self) -> None:
        """Let every held request go on (and no longer hold any)."""
        with self._held:
            self._open = True
            self._held.notify_all()
