"""Sharded trainers publish without gathering: gloo on CPU, 2 and 4 processes.

A tiny Llama is trained a few AdamW steps under FSDP2 (`fully_shard`: every parameter
`Shard(0)`) or under a tensor-parallel plan (`parallelize_module`, colwise q/k/v/gate/up:
`Shard(0)`, rowwise o/down: `Shard(1)`; embeddings and norms stay plain tensors, which
rank 0 publishes). FSDP2's dimensions are chosen uneven (vocabulary 37, MLP width 22)
so that some shards are smaller than others; TP's parallel styles refuse uneven splits
in forward, so under TP the MLP width is 24. Each case starts its ranks (forked from a
server that imported torch and transformers once: `tests/support/ranks.py`); the default
run takes the two cases of 2 ranks, those of 4 are `slow`.
Every rank publishes its own slices; while it does, every Python entry to an all-gather
of floating tensors (`dist.all_gather*`, the functional collectives,
`DTensor.full_tensor` / `redistribute`) raises, so a publish that gathered a weight would
fail. After each version the test itself gathers the full state (outside that window)
and an unsharded publisher publishes it to a second run: followers of both runs must
materialize the same files, bit for bit. In the failing cases one rank's uploads are
refused at one version: nothing is committed for it on any rank, and the next version is a delta
against the last committed one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltaboard.clients.follower import Follower
from tests.support.ranks import run_ranks

VERSIONS = 4
FAIL_AT = 2  # the publish whose uploads the failing rank has refused


def _model(mode: str, world: int) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        # tensor-parallel styles need even splits in forward (torch refuses 22 over 4)
        intermediate_size=22 if mode == "fsdp" else 24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {}
    for i in range(config.num_hidden_layers):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


@contextlib.contextmanager
def _no_weight_gathers() -> Iterator[list[str]]:
    """Every Python entry to an all-gather of floating tensors raises (and is recorded)
    while inside; the publisher's own messages (sizes of pickled objects: int64) pass."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor

    refused: list[str] = []

    def guard(owner: Any, name: str) -> tuple[Any, str, Any]:
        original = getattr(owner, name)

        def refuse(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            if name in ("full_tensor", "redistribute") or any(t.is_floating_point() for t in tensors):
                refused.append(name)
                raise AssertionError(f"{name} on weights while publishing")
            return original(*args, **kwargs)

        return owner, name, refuse

    targets = [
        (dist, "all_gather"),
        (dist, "all_gather_into_tensor"),
        (dist.distributed_c10d, "all_gather"),
        (dist.distributed_c10d, "all_gather_into_tensor"),
        (funcol, "all_gather_tensor"),
        (DTensor, "full_tensor"),
        (DTensor, "redistribute"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets]
    for owner, name, replacement in (guard(o, n) for o, n in targets):
        setattr(owner, name, replacement)
    try:
        yield refused
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _rank_main(
    rank: int, world: int, init_file: str, url: str, token: str, run: str, mode: str, fail_rank: int, out: str
) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from deltaboard.clients.board_client import BoardClient
    from deltaboard.publisher.distributed import TorchDistributedRanks
    from deltaboard.publisher.publisher import Publisher
    from tests.publisher.pub_support import FaultyTransport, error, is_blob_put

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = _model(mode, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(24).reshape(2, 12) % 37
    transport = FaultyTransport()
    client = BoardClient(url, token, transport=transport, retries=1, backoff_s=0.01)
    outcomes: list[dict[str, Any]] = []
    with Publisher(client, run, keyframe_every=100, ranks=TorchDistributedRanks(), assets={}) as pub:
        for i in range(VERSIONS):
            if i:
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            failing = rank == fail_rank and i == FAIL_AT
            transport.rule = (
                (lambda r: error(400, "Injected") if is_blob_put(r) else None) if failing else None
            )
            with _no_weight_gathers() as refused:
                try:
                    r = pub.publish(model, step=i).result()
                    outcomes.append({"version": r.version, "kind": r.kind})
                except Exception as exc:
                    outcomes.append({"error": type(exc).__name__, "message": str(exc)})
            assert not refused, refused
            # the test's reference only, outside the guarded window
            full = {
                k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
            }
            if rank == 0 and "version" in outcomes[-1]:
                torch.save(full, Path(out, f"full{outcomes[-1]['version']}.pt"))
    client.close()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcomes))


def _served(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.name.endswith((".safetensors", ".json"))}


@pytest.mark.parametrize(
    ("mode", "world", "fail_rank"),
    [
        ("fsdp", 2, -1),  # uneven: 37 embedding rows over 2 ranks
        ("tp", 2, 1),  # colwise rows and rowwise columns, one rank failing
        pytest.param("fsdp", 4, 2, marks=pytest.mark.slow),  # uneven: 37 and 22 rows over 4
        pytest.param("tp", 4, 2, marks=pytest.mark.slow),
    ],
)
def test_sharded_ranks_publish_what_an_unsharded_trainer_would(
    board, tmp_path, monkeypatch, mode, world, fail_rank
):
    import torch

    from deltaboard.publisher.publisher import Publisher

    run = f"{mode}-{world}"
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    run_ranks(
        _rank_main,
        (
            world,
            str(tmp_path / "init"),
            board.url,
            board.publish_token,
            run,
            mode,
            fail_rank,
            str(tmp_path),
        ),
        world,
    )
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    committed = VERSIONS if fail_rank < 0 else VERSIONS - 1
    for r in range(world):
        done = [(o["version"], o["kind"]) for o in outcomes[r] if "version" in o]
        assert done == [(0, "full")] + [(v, "delta") for v in range(1, committed)]
    if fail_rank >= 0:
        assert all("error" in outcomes[r][FAIL_AT] for r in range(world))
        assert f"rank {fail_rank}" in outcomes[0][FAIL_AT]["message"]
    reader = board.client(board.read_token)
    assert reader.head(run).version == committed - 1
    manifest = reader.manifest(run, 0)
    assert any(e.part is not None for e in manifest.tensors)  # published in parts, not gathered
    with Publisher(board.client(board.publish_token), f"{run}-whole", keyframe_every=100, assets={}) as pub:
        for v in range(committed):
            assert pub.publish(torch.load(tmp_path / f"full{v}.pt"), step=v).result().version == v
    with (
        Follower(reader, run, tmp_path / "sharded", node_id="a") as sharded,
        Follower(board.client(board.read_token), f"{run}-whole", tmp_path / "whole", node_id="b") as whole,
    ):
        for v in range(committed):
            assert sharded.sync(v) == whole.sync(v) == v
            got, want = _served(sharded.model_dir), _served(whole.model_dir)
            assert got.keys() == want.keys() and "model.safetensors" in got
            assert got == want, v
        assert (
            reader.manifest(run, committed - 1).state_digest
            == reader.manifest(f"{run}-whole", committed - 1).state_digest
        )


def _declared_state(
    version: int, rank: int, world: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A whole state, and this rank's columns of `cols` and rows of `rows` (uneven: 5
    columns, 7 rows) with their declared places."""
    import torch

    g = torch.Generator().manual_seed(version)
    whole = {
        "cols": torch.randn(4, 5, generator=g),
        "rows": torch.randn(7, 3, generator=g),
        "norm": torch.ones(3),
    }
    c0, c1 = 5 * rank // world, 5 * (rank + 1) // world
    r0, r1 = 7 * rank // world, 7 * (rank + 1) // world
    local = {
        "cols": whole["cols"][:, c0:c1].contiguous(),
        "rows": whole["rows"][r0:r1],
        "norm": whole["norm"],
    }
    declared = {"cols": ((4, 5), (0, c0)), "rows": ((7, 3), (r0, 0))}
    return whole, local, declared


def _declared_main(rank: int, world: int, init_file: str, url: str, token: str, run: str) -> None:
    import torch.distributed as dist

    from deltaboard.clients.board_client import BoardClient
    from deltaboard.publisher.distributed import TorchDistributedRanks
    from deltaboard.publisher.publisher import Publisher

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    declared = _declared_state(0, rank, world)[2]
    with (
        BoardClient(url, token) as client,
        Publisher(client, run, ranks=TorchDistributedRanks(slices=declared), assets={}) as pub,
    ):
        for v in range(3):
            pub.publish(_declared_state(v, rank, world)[1], step=v).result()
    dist.destroy_process_group()


@pytest.mark.slow  # 2 processes for what the DTensor cases already cover by boxes; the long form runs it
def test_plain_local_tensors_with_declared_slices(board, tmp_path, monkeypatch):
    """Column and row slices of plain tensors, declared by the caller, assemble into the
    checkpoint an unsharded publisher of the whole tensors produces."""
    from deltaboard.publisher.publisher import Publisher

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    run_ranks(_declared_main, (2, str(tmp_path / "init"), board.url, board.publish_token, "declared"), 2)
    with Publisher(board.client(board.publish_token), "declared-whole", assets={}) as pub:
        for v in range(3):
            pub.publish(_declared_state(v, 0, 1)[0], step=v).result()
    reader = board.client(board.read_token)
    assert [e.part is not None for e in reader.manifest("declared", 2).tensors] == [True] * 4
    with (
        Follower(reader, "declared", tmp_path / "sliced", node_id="a") as sliced,
        Follower(board.client(board.read_token), "declared-whole", tmp_path / "whole", node_id="b") as whole,
    ):
        for v in range(3):
            assert sliced.sync(v) == whole.sync(v) == v
            assert _served(sliced.model_dir) == _served(whole.model_dir), v
