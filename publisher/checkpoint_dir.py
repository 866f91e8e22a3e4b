"""Publish a safetensors Hugging Face checkpoint directory as a run's next version.

For trainers that write checkpoints instead of calling `Publisher.publish` in the loop
(`deltaboard publish DIR --run R`). The previous version's view is the base of the
delta: it is kept in a local cache directory by a rollout follower (`deltaboard.clients.follower`),
which fetches only what changed since the cache's version, and its state digest is
checked against the board before any patch is made against it. With no previous version
(or when the tensor names changed) the directory goes out as a keyframe.

Tensor order is the layout of the run's nearest keyframe, so a delta's shard placement
agrees with the keyframe's whatever order the directory's files list tensors in.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.board.contract.view_spec import INDEX_FILE
from deltaboard.clients.board_client import BoardClient
from deltaboard.publisher.publisher import Publisher, PublishResult

if TYPE_CHECKING:
    from deltaboard.clients.follower.follower import Progress


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors shards of a checkpoint directory, in index order."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / f for f in dict.fromkeys(weight_map.values())]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors file")
    return files


def load_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(directory):
        state.update(load_file(path))
    return state


def keyframe_order(client: BoardClient, run: str, version: int) -> list[str]:
    """Tensor names in the layout of the keyframe that `version` builds on."""
    plan = client.plan(run, None, version)
    keyframe = client.manifest(run, plan.steps[0].version)
    return [t.name for t in keyframe.tensors]


def cached_view(
    client: BoardClient, run: str, version: int, cache_dir: Path, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """The view of `version`, kept current in `cache_dir` by a follower (`progress`
    receives the follower's phases: a cache built from scratch is a whole download)."""
    from deltaboard.clients.follower import Follower

    follower = Follower(client, run, cache_dir, node_id=f"publish-cache-{run}", progress=progress)
    follower.sync(version)
    return load_checkpoint(Path(follower.model_dir))


def publish_directory(
    directory: Path,
    client: BoardClient,
    run: str,
    *,
    spec: ViewSpec | None = None,
    cache_dir: Path,
    keyframe_every: int = 50,
    meta: dict[str, object] | None = None,
    on_uploaded: Callable[[int], None] | None = None,
    cache_progress: Progress | None = None,
) -> PublishResult:
    """Publish `directory` as the next version of `run` (a delta when a base exists);
    `cache_progress` receives the phases of bringing the cache to the base version."""
    state = load_checkpoint(directory)
    with Publisher(
        client, run, spec=spec, assets=directory, keyframe_every=keyframe_every, on_uploaded=on_uploaded
    ) as pub:
        head = pub.next_version - 1
        if head >= 0:
            order = keyframe_order(client, run, head)
            if sorted(order) == sorted(state):
                state = {name: state[name] for name in order}
                base = cached_view(client, run, head, cache_dir, cache_progress)
                pub.adopt_base(head, {name: base[name] for name in order})
        future = pub.publish(state, meta={"source": str(directory), **(meta or {})})
        return future.result()
