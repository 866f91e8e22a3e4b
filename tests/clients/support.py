"""Helpers of the follower tests: synthetic trainer states, publishing them through the real
`Publisher`, and reading a follower directory back with safetensors (an independent reader)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.clients.board_client import BoardClient
from deltaboard.publisher.publisher import Publisher
from deltaboard.publisher.view import rollout_view, tensor_bytes

CONFIG = {"model_type": "test", "architectures": ["Test"]}


def make_state(sizes: Mapping[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights of the given shapes, at the scale of a small LM's weights."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.02 for name, shape in sizes.items()}


def step_state(state: dict[str, torch.Tensor], step: int, lr: float = 5e-5) -> None:
    """An update moving every weight by lr x |w|: about 1% of the bf16 view changes,
    by one ULP, like an RL step at lr 1e-6."""
    g = torch.Generator().manual_seed(10_000 + step)
    for t in state.values():
        t.add_(torch.randn(t.shape, generator=g).sign() * t.abs() * lr)


def states(
    sizes: Mapping[str, tuple[int, ...]], versions: int, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """The trainer's state at versions 0..versions-1 (yielded live: copy what you keep)."""
    state = make_state(sizes, seed)
    for v in range(versions):
        yield state
        step_state(state, v)


def view_of(state: Mapping[str, torch.Tensor], spec: ViewSpec | None = None) -> dict[str, np.ndarray]:
    return {k: tensor_bytes(v).copy() for k, v in rollout_view(dict(state), spec or ViewSpec()).items()}


def publish_states(
    client: BoardClient,
    run: str,
    sizes: Mapping[str, tuple[int, ...]],
    versions: int,
    *,
    keyframe_every: int = 50,
    spec: ViewSpec | None = None,
    seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """Publish `versions` versions through the real publisher; returns each version's view."""
    views = []
    assets = {"config.json": json.dumps(CONFIG).encode()}
    with Publisher(client, run, keyframe_every=keyframe_every, spec=spec, assets=assets) as pub:
        for state in states(sizes, versions, seed):
            views.append(view_of(state, spec))
            pub.publish(state).result()
    return views


def read_dir(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor's raw bytes as safetensors reads them from a checkpoint directory."""
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for file in files:
        with safe_open(str(directory / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[name] = tensor_bytes(f.get_tensor(name)).copy()
    return out


def assert_view(directory: Path, want: Mapping[str, np.ndarray]) -> None:
    got = read_dir(directory)
    assert sorted(got) == sorted(want)
    for name, data in want.items():
        assert np.array_equal(got[name], data), name
