"""The publisher's lease keeper against a board client that injects the board's answers to
its renewals: which answers fence the publisher and which are tried again."""

from __future__ import annotations

import threading
import time

import pytest

from deltaboard.board.contract.errors import BoardError, Contended, StaleEpoch
from deltaboard.board.contract.schemas import Lease
from deltaboard.publisher.lease import FencedError, LeaseKeeper

TTL_S = 6.0  # a renewal every 2 s; a refused one tried again after 0.6 s, well inside the TTL


class Answers:
    """A lease client whose renewals raise `refusals` first, then succeed."""

    def __init__(self, *refusals: BoardError) -> None:
        self.refusals = list(refusals)
        self.renewed = threading.Event()

    def acquire_lease(self, run: str, holder: str, ttl_s: float = 30.0, *, steal: bool = False) -> Lease:
        return Lease(run=run, holder=holder, epoch=1, expires_at=time.time() + ttl_s)

    def renew_lease(self, run: str, holder: str, epoch: int, ttl_s: float = 30.0) -> Lease:
        if self.refusals:
            raise self.refusals.pop(0)
        self.renewed.set()
        return Lease(run=run, holder=holder, epoch=epoch, expires_at=time.time() + ttl_s)

    def release_lease(self, run: str, holder: str, epoch: int) -> None:
        pass


def fenced(keeper: LeaseKeeper) -> bool:
    try:
        keeper.check()
    except FencedError:
        return True
    return False


def test_a_contended_renewal_is_tried_again_not_fenced():
    """The board answers `Contended` when the lease record kept changing under its
    compare-and-set (the holder's own renewals racing): a reason to try again."""
    client = Answers(Contended("lease record kept changing; retry"))
    keeper = LeaseKeeper(client, "r", "trainer", TTL_S)
    try:
        deadline = time.monotonic() + 60
        while not client.renewed.wait(0.05) and not fenced(keeper) and time.monotonic() < deadline:
            pass
        assert not fenced(keeper)
        assert client.renewed.is_set() and not client.refusals
    finally:
        keeper.release()


def test_a_stale_epoch_fences():
    client = Answers(StaleEpoch("epoch 1 of 'trainer' is not the current lease", current_epoch=2))
    keeper = LeaseKeeper(client, "r", "trainer", TTL_S)
    try:
        deadline = time.monotonic() + 60
        while not fenced(keeper) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(FencedError, match="StaleEpoch"):
            keeper.check()
        assert not client.renewed.is_set()
    finally:
        keeper.release()
