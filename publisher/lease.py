"""The writer lease: one publisher per run, fenced by an epoch.

The board hands out a lease with a new epoch and refuses commits carrying an older one,
so a restarted or duplicated trainer cannot fork a run. The keeper renews the lease in
a background thread at a third of its TTL; once the board answers that our epoch is
stale (someone else took the run), or the lease could not be renewed before it expired,
the publisher is *fenced*: every pending and later publish fails with `FencedError`,
which says so plainly instead of surfacing as an opaque 409. Taking a lease another
writer still holds (a trainer restarted before its old lease ran out) is `LeaseHeld`,
which says how long the lease has left and what `steal_lease=True` would do.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Protocol

from deltaboard.board.contract.errors import BoardError, BoardUnavailable, Contended, LeaseHeld
from deltaboard.board.contract.schemas import Lease


class FencedError(RuntimeError):
    """This publisher lost the run's writer lease; it must stop publishing."""


class LeaseClient(Protocol):
    def acquire_lease(self, run: str, holder: str, ttl_s: float = ..., *, steal: bool = ...) -> Lease: ...
    def renew_lease(self, run: str, holder: str, epoch: int, ttl_s: float = ...) -> Lease: ...
    def release_lease(self, run: str, holder: str, epoch: int) -> None: ...


def held_message(run: str, exc: LeaseHeld) -> str:
    """`LeaseHeld` in words: who holds the run, for how long yet, and the two ways on."""
    holder = exc.extra.get("holder", "another writer")
    expires_at = exc.extra.get("expires_at")
    left = (
        "a while"
        if not isinstance(expires_at, int | float)
        else f"{max(0.0, expires_at - time.time()):.0f} s more"
    )
    return (
        f"run {run!r} is held by writer {holder!r}, whose lease lasts {left} unless it renews it "
        f"(a crashed or stopped trainer's lease runs out on its own). Wait and try again, or pass "
        f"steal_lease=True to take the run now: the other writer is fenced off, and its next "
        f"commit fails."
    )


class LeaseKeeper:
    """Holds and renews one run's lease; `check()` raises once fenced."""

    def __init__(
        self, client: LeaseClient, run: str, holder: str, ttl_s: float, *, steal: bool = False
    ) -> None:
        self._client = client
        self._run = run
        self._holder = holder
        self._ttl_s = ttl_s
        self._stop = threading.Event()
        self._fenced: FencedError | None = None
        self._lock = threading.Lock()
        try:
            lease = client.acquire_lease(run, holder, ttl_s, steal=steal)
        except LeaseHeld as exc:
            raise LeaseHeld(held_message(run, exc), http_status=exc.http_status, **exc.extra) from exc
        self.epoch = lease.epoch
        self._expires_at = time.monotonic() + ttl_s
        self._thread = threading.Thread(target=self._renew_loop, name=f"deltaboard-lease-{run}", daemon=True)
        self._thread.start()

    def check(self) -> None:
        with self._lock:
            if self._fenced is not None:
                raise self._fenced

    def fence(self, reason: str) -> FencedError:
        """Mark the publisher fenced (also called when a commit is refused as stale)."""
        with self._lock:
            if self._fenced is None:
                self._fenced = FencedError(
                    f"publisher {self._holder!r} (epoch {self.epoch}) was fenced off run {self._run!r}: "
                    f"{reason}. Another writer holds the run; stop this trainer or start a new run."
                )
            self._stop.set()
            return self._fenced

    def take_new_epoch(self) -> int:
        """Take a new lease, with a higher epoch, as the same holder: a manifest that our
        own crashed commit left above head (same epoch, other bytes) blocks that version
        for our epoch, and the board replaces a leftover of a lower epoch. Fences us (and
        raises `FencedError`) if another holder's lease is live."""
        try:
            lease = self._client.acquire_lease(self._run, self._holder, self._ttl_s)
        except LeaseHeld as exc:
            raise self.fence(f"another holder took the lease ({exc.message})") from exc
        with self._lock:
            self.epoch = lease.epoch
            self._expires_at = time.monotonic() + self._ttl_s
        return lease.epoch

    def _renew_loop(self) -> None:
        interval = self._ttl_s / 3
        while not self._stop.wait(interval):
            epoch = self.epoch
            try:
                self._client.renew_lease(self._run, self._holder, epoch, self._ttl_s)
                with self._lock:
                    if self.epoch == epoch:
                        self._expires_at = time.monotonic() + self._ttl_s
                interval = self._ttl_s / 3
            except Exception as exc:
                if self.epoch != epoch:
                    continue  # `take_new_epoch` replaced the lease we were renewing
                # The client already retried transport errors and 5xx; any other refusal is
                # the board's answer, but `Contended` (the lease record kept changing under
                # the board's compare-and-set), which asks for another try.
                if isinstance(exc, BoardError) and not isinstance(exc, BoardUnavailable | Contended):
                    self.fence(f"the board refused to renew the lease ({exc.code}: {exc.message})")
                    return
                if time.monotonic() >= self._expires_at:
                    self.fence(f"the lease expired while the board was unreachable ({exc})")
                    return
                interval = min(1.0, self._ttl_s / 10)

    def release(self) -> None:
        """Stop renewing and give the lease back (best effort: it expires anyway)."""
        self._stop.set()
        self._thread.join()
        if self._fenced is None:
            # A lease we cannot release expires after its TTL; close() must not fail for it.
            with contextlib.suppress(Exception):
                self._client.release_lease(self._run, self._holder, self.epoch)
