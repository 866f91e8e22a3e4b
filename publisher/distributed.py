"""Several ranks, one version (docs/contract.md section 5).

Every rank snapshots, diffs, encodes and uploads the tensors it owns, in its own
background worker. Their parts (or the reason they failed) are gathered to rank 0 over a
dedicated gloo group; rank 0 commits one manifest only if every rank succeeded, and
broadcasts the verdict. So a version commits atomically or not at all: a rank that fails
mid-publish leaves only orphan blobs on the board, which retention collects, and every
rank keeps its last committed view as the base of the next delta.

All ranks must call `publish` the same number of times, as they call any collective.
Only rank 0 holds the writer lease. The gloo group is separate from the training's
process group, so publishing never interleaves with the trainer's own collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from deltaboard.publisher.encode import RankVersion
from deltaboard.publisher.lease import FencedError, LeaseKeeper
from deltaboard.publisher.manifest import Proposal
from deltaboard.publisher.publisher import Publisher, PublishError


def partition_by_name(
    state: Mapping[str, torch.Tensor], rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """The tensors `rank` owns: greedy by size, in state-dict order, the same on every rank."""
    loads = [0] * world_size
    mine: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        owner = loads.index(min(loads))
        loads[owner] += tensor.numel() * tensor.element_size()
        if owner == rank:
            mine[name] = tensor
    return mine


@dataclass(frozen=True)
class _Verdict:
    status: Literal["ok", "failed", "fenced"]
    message: str
    next_version: int
    forget_base: bool


class DistributedPublisher(Publisher):
    """A `Publisher` per rank; `publish(owned_state)` on every rank makes one version."""

    def __init__(
        self, board: Any, run: str, *, group: dist.ProcessGroup | None = None, **kwargs: Any
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedPublisher needs torch.distributed to be initialized")
        self._group = group if group is not None else dist.new_group(backend="gloo")
        self.rank = dist.get_rank(self._group)
        self.world_size = dist.get_world_size(self._group)
        self._open_error: BaseException | None = None
        self._fenced: FencedError | None = None
        super().__init__(board, run, **kwargs)

    def _open_run(self, holder: str, ttl_s: float, steal: bool) -> LeaseKeeper | None:
        if self.rank != 0:
            return None
        try:
            return super()._open_run(holder, ttl_s, steal)
        except Exception as exc:  # every rank must hear of it, or they would wait forever
            self._open_error = exc
            return None

    def _initial_version(self) -> int:
        """Rank 0 reads the head (after taking the lease) and tells the others."""
        message: list[Any] = [None]
        if self.rank == 0:
            message[0] = repr(self._open_error) if self._open_error else self._board_next_version()
        dist.broadcast_object_list(message, src=0, group=self._group)
        if self._open_error is not None:
            raise self._open_error
        if isinstance(message[0], str):
            raise PublishError(f"rank 0 could not open run {self.run!r}: {message[0]}")
        return int(message[0])

    def _check_open(self) -> None:
        """Every rank learns of fencing from the same verdict, so every rank stops together
        (rank 0 refusing alone would leave the others waiting in the gather)."""
        if self._fenced is not None:
            raise self._fenced

    def _agree(self, proposal: Proposal, outcome: RankVersion | BaseException) -> int:
        payload: RankVersion | str = (
            outcome if isinstance(outcome, RankVersion) else f"rank {self.rank}: {outcome!r}"
        )
        gathered: list[RankVersion | str] | None = [""] * self.world_size if self.rank == 0 else None
        dist.gather_object(payload, gathered, dst=0, group=self._group)
        verdict = [self._decide(proposal, gathered)] if gathered is not None else [None]
        dist.broadcast_object_list(verdict, src=0, group=self._group)
        decided = verdict[0]
        assert decided is not None
        if decided.forget_base and self.rank != 0:
            self._pipeline.forget_base()
        self.next_version = decided.next_version
        if decided.status == "ok":
            return proposal.version
        if decided.status == "fenced":
            self._fenced = FencedError(decided.message)
        if isinstance(outcome, BaseException):
            raise outcome
        raise self._fenced or PublishError(decided.message)

    def _decide(self, proposal: Proposal, gathered: list[RankVersion | str]) -> _Verdict:
        assert self._lease is not None
        try:
            self._lease.check()
        except FencedError as exc:
            return _Verdict("fenced", str(exc), proposal.version, False)
        failures = [g for g in gathered if isinstance(g, str)]
        if failures:
            return _Verdict(
                "failed",
                f"version {proposal.version} not committed: {'; '.join(failures)}",
                proposal.version,
                False,
            )
        ranks = [g for g in gathered if isinstance(g, RankVersion)]
        try:
            self._commit(proposal, ranks)
        except FencedError as exc:
            return _Verdict("fenced", str(exc), proposal.version, False)
        except Exception as exc:
            resynced = self.next_version != proposal.version
            return _Verdict("failed", str(exc), self.next_version, resynced)
        return _Verdict("ok", "", proposal.version + 1, False)
