"""Several ranks, one version (docs/contract.md section 5): the rank-coordination port
(`ranks.RankCoordinator`) over torch.distributed.

    ranks = TorchDistributedRanks(partition=partition_by_name)  # after init_process_group
    pub = Publisher(board, run, ranks=ranks)                     # on every rank
    pub.publish(model, step=step)                                # on every rank

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

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from deltaboard.publisher.encode import RankVersion
from deltaboard.publisher.publisher import PublishError
from deltaboard.publisher.ranks import Decide, LocalSlice, RankReport, Verdict, report
from deltaboard.publisher.shards import Declared, local_shards

Partition = Callable[[Mapping[str, torch.Tensor], int, int], Mapping[str, torch.Tensor]]
"""`(state, rank, world_size) -> the part of state that rank publishes`."""


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


class TorchDistributedRanks:
    """The ranks of a torch.distributed world, coordinated over a gloo group of their own.

    `partition` picks each rank's part of the state passed to `publish`; without it every
    rank passes only the tensors it owns. A state holding `DTensor`s (FSDP2, tensor
    parallel), or names in `slices` (`{name: (whole shape, offset)}` of plain local
    tensors), is sharded: every rank passes its whole state dict and publishes its own
    slice of each tensor (`shards.local_shards`), plain tensors being rank 0's.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        partition: Partition | None = None,
        slices: Declared | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchDistributedRanks needs torch.distributed to be initialized")
        self._group = group if group is not None else dist.new_group(backend="gloo")
        self.rank = dist.get_rank(self._group)
        self.world_size = dist.get_world_size(self._group)
        self._partition = partition
        self._declared: Declared = dict(slices or {})

    def _sharded(self, state: Mapping[str, torch.Tensor]) -> bool:
        return bool(self._declared) or any(isinstance(t, DTensor) for t in state.values())

    def local_state(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        if self._sharded(state):
            return local_shards(state, self._declared, self.rank)[0]
        if self._partition is None:
            return state
        return self._partition(state, self.rank, self.world_size)

    def local_slices(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, LocalSlice]:
        return local_shards(state, self._declared, self.rank)[1] if self._sharded(state) else {}

    def open_run(self, lead: Callable[[], int]) -> int:
        """Rank 0 opens the run and reads the head (after taking the lease) and tells the others."""
        message: list[Any] = [None]
        failure: Exception | None = None
        if self.rank == 0:
            try:
                message[0] = lead()
            except Exception as exc:  # every rank must hear of it, or they would wait forever
                failure = exc
                message[0] = repr(exc)
        dist.broadcast_object_list(message, src=0, group=self._group)
        if failure is not None:
            raise failure
        if isinstance(message[0], str):
            raise PublishError(f"rank 0 could not open the run: {message[0]}")
        return int(message[0])

    def settle_version(self, outcome: RankVersion | BaseException, decide: Decide) -> Verdict:
        gathered: list[RankReport] | None = [""] * self.world_size if self.rank == 0 else None
        dist.gather_object(report(self.rank, outcome), gathered, dst=0, group=self._group)
        verdict = [decide(gathered)] if gathered is not None else [None]
        dist.broadcast_object_list(verdict, src=0, group=self._group)
        decided = verdict[0]
        assert isinstance(decided, Verdict)
        return decided
