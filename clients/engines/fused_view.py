"""One TP rank of a serving engine, patched in place: the engine side of the SGLang and
vLLM hot paths.

Both engines run one process per tensor-parallel rank, and both hot paths apply a
version in two calls to every rank, so that a patch is written on all ranks or on none:

- **stage** (`stage_file`): read the patch file the sidecar wrote (`write_patch`), keep
  the part this rank holds (`fused.Layout.shard`), check that the engine's parameters
  have the shapes the layout says, that they hold the patch's old bits at every changed
  element (read only), and stage the changes next to the weights (`ResidentView.stage`).
  The rank answers a `Verdict` instead of raising, so that the engine keeps serving when
  a patch does not fit; the sidecar commits only when every rank's verdict is ok, and
  discards otherwise.
- **commit** (`commit`): swap the staged changes in, between two forward passes
  (`ResidentView.commit`: all or nothing on the rank, the old bits checked again in the
  same pass). A mismatch here means something else wrote the weights since the stage:
  the rank restores its weights and raises `BaseMismatch`, loudly.

What a rank has staged is kept per model object (each engine rank holds one model; an
imitation holding several ranks in one process holds several), until its commit or
discard, or the next stage replaces it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from deltaboard.board import codec
from deltaboard.clients.engines.fused import Layout, ModelDims
from deltaboard.clients.resident import (
    BaseMismatch,
    CommitReport,
    HotPatch,
    ResidentError,
    ResidentView,
    read_patch,
)
from deltaboard.clients.resident.view import StagedPatch

Post = Callable[[str, dict[str, Any]], Any]
"""How a hot path reaches its engine: POST a JSON body to a path, return the decoded
answer, raise `EngineAdapterError` on an HTTP error (the adapter's `_call(...).json()`)."""


@dataclass(frozen=True)
class Verdict:
    """One rank's answer to a stage: `ok`, the elements it will swap, or why not."""

    rank: int
    ok: bool
    version: int | None
    changed: int
    error: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Verdict:
        version = data.get("version")
        return cls(
            rank=int(data["rank"]),
            ok=bool(data["ok"]),
            version=None if version is None else int(version),
            changed=int(data["changed"]),
            error=str(data["error"]),
        )


class HotPatchRefused(ResidentError):
    """A rank refused the patch at stage: nothing was written on any rank."""

    def __init__(self, verdicts: list[Verdict]) -> None:
        refused = [f"rank {v.rank}: {v.error}" for v in verdicts if not v.ok]
        super().__init__("the engine refused the hot patch (" + "; ".join(refused) + ")")
        self.verdicts = verdicts


def check_verdicts(verdicts: list[Verdict], tp_size: int, version: int) -> None:
    """Raise `HotPatchRefused` unless every rank of `tp_size` staged `version`."""
    ranks = sorted(v.rank for v in verdicts)
    if ranks != list(range(tp_size)):
        missing = Verdict(-1, False, version, 0, f"verdicts came from ranks {ranks}, not 0..{tp_size - 1}")
        raise HotPatchRefused([*verdicts, missing])
    if not all(v.ok and v.version == version for v in verdicts):
        raise HotPatchRefused(verdicts)


@dataclass(frozen=True)
class _Staged:
    view: ResidentView
    staged: StagedPatch


_STAGED: weakref.WeakKeyDictionary[torch.nn.Module, _Staged] = weakref.WeakKeyDictionary()


def stage_file(model: torch.nn.Module, path: Path, tp_size: int, rank: int) -> Verdict:
    """Stage the patch at `path` on TP rank `rank` of `model`. Never raises: whatever
    goes wrong (an unreadable file, a patch that does not fit the model or its weights)
    is the verdict's error, and nothing stays staged; raising would stop SGLang."""
    _STAGED.pop(model, None)
    version = None
    try:
        patch = read_patch(path)
        version = patch.version
        config: Any = model.config  # the Hugging Face config both engines keep on their models
        layout = Layout(ModelDims.from_config(config.to_dict()), tp_size, rank)
        local = layout.shard(patch)
        view = ResidentView(_bind(model, layout, local), patch.base_version)
        staged = view.stage(local)
    except Exception as exc:  # inside the engine any failure is a refusal, reported, not a crash
        return Verdict(rank, False, version, 0, f"{type(exc).__name__}: {exc}")
    _STAGED[model] = _Staged(view, staged)
    return Verdict(rank, True, version, local.changed, "")


def commit(model: torch.nn.Module, version: int) -> CommitReport:
    """Swap in what `stage_file` staged for `version` on this model; `ResidentError`
    when nothing is staged for it, `BaseMismatch` (weights restored) when the weights
    changed since."""
    staged = _STAGED.pop(model, None)
    if staged is None or staged.staged.version != version:
        held = None if staged is None else staged.staged.version
        raise ResidentError(f"version {version} is not staged on this rank (staged: {held})")
    return staged.view.commit(staged.staged)


def discard(model: torch.nn.Module) -> None:
    """Drop what is staged on this model, if anything."""
    _STAGED.pop(model, None)


def _bind(model: torch.nn.Module, layout: Layout, patch: HotPatch) -> dict[str, torch.Tensor]:
    """The parameters `patch` changes, checked against the layout's shapes and the
    patch's old bits (read only: a refused patch writes nothing)."""
    params = dict(model.named_parameters())
    shapes = layout.param_shapes()
    tensors: dict[str, torch.Tensor] = {}
    for t in patch.tensors():
        param = params.get(t.name)
        if param is None:
            raise ResidentError(f"the engine has no parameter {t.name!r} on rank {layout.rank}")
        if tuple(param.shape) != shapes[t.name]:
            raise ResidentError(
                f"the engine's {t.name!r} is {tuple(param.shape)} on rank {layout.rank}; "
                f"the fused layout says {shapes[t.name]}"
            )
        live = param.data
        width = live.element_size()
        if width != codec.width(t.dtype):
            raise ResidentError(
                f"the engine's {t.name!r} has {width}-byte elements, the patch's are {t.dtype}"
            )
        ints = live.view(getattr(torch, f"int{8 * width}")).view(-1)
        held = ints[torch.from_numpy(t.positions).to(live.device)]
        if not torch.equal(held, torch.from_numpy(t.old_bits.view(f"<i{width}")).to(live.device)):
            base = patch.base_version
            raise BaseMismatch(f"{t.name!r} does not hold the patch's base {base} on rank {layout.rank}")
        tensors[t.name] = live
    return tensors
