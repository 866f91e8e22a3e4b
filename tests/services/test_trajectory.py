"""Training trajectories: deterministic, both regimes, sparse view changes, cached."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.publisher.view import rollout_view, tensor_bytes
from deltaboard.services.trajectory import build_model, load_trajectory, train


def view_bytes(model: torch.nn.Module) -> np.ndarray:
    return np.concatenate([tensor_bytes(t) for t in rollout_view(model.state_dict(), ViewSpec()).values()])


def test_tiny_model_size() -> None:
    n = sum(p.numel() for p in build_model("tiny", seed=0).parameters())
    assert 1_000_000 <= n <= 3_000_000


def test_training_is_deterministic_and_moves_few_view_bits() -> None:
    runs = []
    for _ in range(2):
        model = build_model("tiny", seed=1)
        views = [view_bytes(model) for _ in train(model, steps=2, lr=1e-6, regime="fp32-master", seed=1)]
        runs.append(views)
        assert next(model.parameters()).dtype == torch.float32
    assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))
    v0, v1 = runs[0][0].view(np.uint16), runs[0][1].view(np.uint16)
    changed = np.count_nonzero(v0 != v1) / v0.size
    assert 0 < changed < 0.2


def test_bf16_regime_trains_bf16_parameters() -> None:
    model = build_model("tiny", seed=0)
    before = view_bytes(model)
    steps = list(train(model, steps=1, lr=1e-4, regime="bf16", seed=0))
    assert steps == [0, 1]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not np.array_equal(before, view_bytes(model))


def test_trajectory_cache_rebuilds_every_step(tmp_path: Path) -> None:
    traj = load_trajectory(
        size="tiny", regime="fp32-master", lr=1e-5, steps=3, warmup_steps=2, cache=tmp_path
    )
    model = build_model("tiny", seed=0)
    expected = [
        view_bytes(model) for _ in train(model, steps=3, lr=1e-5, regime="fp32-master", warmup_steps=2)
    ]
    for step in (3, 0, 2, 1):
        got = np.concatenate(list(traj.view(step).values()))
        assert np.array_equal(got, expected[step])
    assert traj.view_bytes == expected[0].size
    again = load_trajectory(
        size="tiny", regime="fp32-master", lr=1e-5, steps=3, warmup_steps=2, cache=tmp_path
    )
    assert again.directory == traj.directory
    assert len(list(tmp_path.iterdir())) == 1
