"""The rank-coordination port: how the processes that publish one run agree on each version.

`Publisher(board, run, ranks=...)` is handed one; it never asks how many processes there
are beyond that. One rank, the leader (rank 0), holds the writer lease and commits; every
rank snapshots, encodes and uploads its own part of the state:

    ranks.local_state(state)               # the part of the state this rank publishes
    ranks.local_slices(state)              # where those tensors sit in whole ones (sharded)
    ranks.open_run(lead)                   # the leader opens the run; all learn the version
    ranks.settle_version(outcome, decide)  # each rank's outcome to the leader, its verdict back

`SingleRank` (the default) is one process doing everything, with no messages at all;
`distributed.TorchDistributedRanks` is the same protocol over a torch.distributed group.
Every rank must make the same calls in the same order, as with any collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from deltaboard.publisher.encode import LocalSlice, RankVersion

RankReport = RankVersion | str
"""A rank's uploaded part of a version, or why it failed ("rank N: ..."): exceptions do not
cross processes, their text does."""


@dataclass(frozen=True)
class Verdict:
    """The leader's decision on one version, which every rank then acts on."""

    status: Literal["ok", "failed", "fenced"]
    message: str  # why not "ok"
    next_version: int  # the version every rank proposes next
    resynced: bool  # the leader moved to the board's head: every rank drops its base
    manifest_bytes: int = 0  # the committed manifest's size ("ok" only)


Decide = Callable[[Sequence[RankReport]], Verdict]
"""The leader's step: from every rank's report (in rank order), commit or not."""


class RankCoordinator(Protocol):
    """The ranks that publish one run together, and the messages between them."""

    @property
    def rank(self) -> int:
        """This process's rank; rank 0 leads (holds the lease, commits)."""
        ...

    @property
    def world_size(self) -> int: ...

    def local_state(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The part of the caller's state that this rank snapshots, encodes and uploads."""
        ...

    def local_slices(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, LocalSlice]:
        """Where each tensor of `local_state(state)` sits in its whole tensor; empty when
        every rank publishes whole tensors of its own."""
        ...

    def open_run(self, lead: Callable[[], int]) -> int:
        """The leader calls `lead` (create the run, take the lease, read the next version);
        every rank returns its result. If it raised, the leader raises that and every other
        rank raises too."""
        ...

    def settle_version(self, outcome: RankVersion | BaseException, decide: Decide) -> Verdict:
        """Bring every rank's outcome of one version to the leader, which calls `decide` on
        them all; every rank returns the leader's verdict."""
        ...


def report(rank: int, outcome: RankVersion | BaseException) -> RankReport:
    return outcome if isinstance(outcome, RankVersion) else f"rank {rank}: {outcome!r}"


class SingleRank:
    """One process publishes the whole state: it leads, and the verdict is its own."""

    rank = 0
    world_size = 1

    def local_state(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return state

    def local_slices(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, LocalSlice]:
        return {}

    def open_run(self, lead: Callable[[], int]) -> int:
        return lead()

    def settle_version(self, outcome: RankVersion | BaseException, decide: Decide) -> Verdict:
        return decide([report(self.rank, outcome)])


__all__ = ["Decide", "LocalSlice", "RankCoordinator", "RankReport", "SingleRank", "Verdict"]
