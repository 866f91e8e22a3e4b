"""Several ranks, one version: torch.distributed (gloo, CPU) with 2 and 4 processes.

Each rank's `Publisher` (handed `TorchDistributedRanks`) publishes its partition of the
same state; rank 0 commits only when every rank's part is uploaded. With 2 ranks the
publisher picks each rank's part of the whole state, with 4 each rank passes only its own
(as under sharded training). In the failure case, one rank's uploads are refused while it
publishes a version: no rank commits it, the head stays, and the next version is a delta
against the last committed view that rebuilds exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.publisher.pub_support import assert_same_view, materialize, view_bytes
from tests.support.ranks import run_ranks

VERSIONS = 3
FAIL_AT = 1  # the version index at which the failing rank's uploads are refused


def _state(version: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    state = {f"layers.{i}.weight": torch.randn(16, 8 + i, generator=g) * 0.02 for i in range(6)}
    state["norm"] = torch.ones(8)
    for v in range(1, version + 1):
        gv = torch.Generator().manual_seed(100 + v)
        for name in list(state)[:4]:
            state[name] = (
                state[name] + torch.randn(state[name].shape, generator=gv) * state[name].abs() * 0.05
            )
    return state


def _rank_main(
    rank: int, world: int, init_file: str, url: str, token: str, run: str, fail_rank: int, out: str
):
    import torch.distributed as dist

    from deltaboard.clients.board_client import BoardClient
    from deltaboard.publisher.distributed import TorchDistributedRanks, partition_by_name
    from deltaboard.publisher.publisher import Publisher
    from tests.publisher.pub_support import FaultyTransport, error, is_blob_put

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    transport = FaultyTransport()
    client = BoardClient(url, token, transport=transport, retries=1, backoff_s=0.01)
    outcomes: list[dict[str, Any]] = []
    ranks = TorchDistributedRanks(partition=partition_by_name if world == 2 else None)
    with Publisher(client, run, keyframe_every=100, ranks=ranks, assets={}) as pub:
        for i in range(VERSIONS):
            failing = rank == fail_rank and i == FAIL_AT
            transport.rule = (
                (lambda r: error(400, "Injected") if is_blob_put(r) else None) if failing else None
            )
            mine = partition_by_name(_state(i), rank, world)
            try:
                r = pub.publish(_state(i) if world == 2 else mine, step=i).result()
                outcomes.append({"version": r.version, "kind": r.kind, "tensors": sorted(mine)})
            except Exception as exc:
                outcomes.append({"error": type(exc).__name__, "message": str(exc)})
    client.close()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcomes))


@pytest.mark.parametrize(("world", "fail_rank"), [(2, -1), (4, 2)])
def test_ranks_commit_one_version_atomically(board, tmp_path, monkeypatch, world, fail_rank):
    run = f"dist-{world}"
    # the ranks import this module by name: they take the parent's sys.path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    run_ranks(
        _rank_main,
        (world, str(tmp_path / "init"), board.url, board.publish_token, run, fail_rank, str(tmp_path)),
        world,
    )
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    reader = board.client(board.read_token)
    owned = [set(o["tensors"]) for o in (outcomes[r][0] for r in range(world))]
    assert set.union(*owned) == set(_state(0)) and sum(map(len, owned)) == len(_state(0))
    if fail_rank < 0:
        for r in range(world):
            assert [(o["version"], o["kind"]) for o in outcomes[r]] == [
                (0, "full"),
                (1, "delta"),
                (2, "delta"),
            ]
        for v in range(VERSIONS):
            assert_same_view(materialize(reader, run, v), view_bytes(_state(v)))
        return
    for r in range(world):  # every rank saw the same failure, none committed it
        assert outcomes[r][FAIL_AT]["error"] in ("PublishError", "BoardError")
        assert (outcomes[r][2]["version"], outcomes[r][2]["kind"]) == (1, "delta")
    assert f"rank {fail_rank}" in outcomes[0][FAIL_AT]["message"]
    assert reader.head(run).version == 1
    assert reader.manifest(run, 1).meta["step"] == 2
    assert_same_view(materialize(reader, run, 0), view_bytes(_state(0)))
    assert_same_view(materialize(reader, run, 1), view_bytes(_state(2)))
