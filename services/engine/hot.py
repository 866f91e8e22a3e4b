"""The reference engine's hot path: its model's own parameters as a resident view.

`deltaboard engine --hot` serves from weights patched in place. The sidecar prepares each
version (fetch, sha256, decode against its served slot) and writes it as a patch file
next to the checkpoint; the engine then

- stages it (`POST /weights/stage {"patch": PATH, "weight_version": N}`) while it keeps
  generating: bounds and base checks, addresses, the arrays next to the weights;
- commits it (`POST /weights/commit {"weight_version": N}`): the weight slot stops
  admitting forward passes, waits for the one running, swaps the staged changes in (all or
  nothing) and installs the same model under version N, which moves the load counter
  (so a stamp always names the weights a token was computed with), then resumes.

The parameters are bound by their state-dict names, one name per storage: a tied output
head shares the embeddings' storage, and the view publishes only the embeddings, as
`save_pretrained` does. A reload (`/reload`) replaces the model; the next stage binds the
new one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deltaboard.clients.resident import ResidentError, read_patch
from deltaboard.clients.resident.view import ResidentView, StagedPatch
from deltaboard.services.engine.runtime import LoadedModel, WeightSlot


def served_parameters(model: Any) -> dict[str, Any]:
    """The model's tensors by state-dict name, the first name of each storage only."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    return tensors


@dataclass(frozen=True)
class HotCommit:
    version: int
    loads: int
    changed: int
    pause_s: float  # the swap itself
    held_s: float  # generation held: the swap plus waiting for the forward pass in flight


class HotWeights:
    """Stage and commit patch files into the model the slot holds."""

    def __init__(self, slot: WeightSlot) -> None:
        self.slot = slot
        self._lock = threading.Lock()
        self._view: ResidentView | None = None
        self._bound: Any = None  # the model object the view is bound to
        self._staged: StagedPatch | None = None

    def _view_of(self, loaded: LoadedModel) -> ResidentView:
        if self._view is None or self._bound is not loaded.model or self._view.version != loaded.version:
            tensors = served_parameters(loaded.model)
            if self._view is None:
                self._view = ResidentView(tensors, loaded.version)
            else:
                self._view.bind(tensors, loaded.version)
            self._bound = loaded.model
        return self._view

    def stage(self, patch_path: Path, version: int) -> StagedPatch:
        """Stage the patch at `patch_path` (it must take the served version to `version`)."""
        loaded = self.slot.current
        if loaded is None:
            raise ResidentError("no weights loaded: a hot update patches loaded weights")
        try:
            patch = read_patch(patch_path)
        except (OSError, ValueError, KeyError) as exc:
            raise ResidentError(f"cannot read the patch {patch_path}: {exc}") from exc
        if patch.version != version:
            raise ResidentError(f"{patch_path} takes the weights to {patch.version}, not {version}")
        with self._lock:
            staged = self._view_of(loaded).stage(patch)
            self._staged = staged
        return staged

    def commit(self, version: int) -> HotCommit:
        """Swap the staged `version` in between two forward passes."""
        with self._lock:
            staged, view = self._staged, self._view
            if staged is None or view is None or staged.version != version:
                raise ResidentError(f"version {version} is not staged")
            self._staged = None
            started = time.perf_counter()
            self.slot.pause()
            try:
                loaded = self.slot.current
                if loaded is None or loaded.model is not self._bound:
                    raise ResidentError("the engine reloaded since the patch was staged")
                report = view.commit(staged)
                _, loads = self.slot.install(replace(loaded, version=version))
            finally:
                self.slot.resume()
            held = time.perf_counter() - started
        return HotCommit(version, loads, report.changed, report.pause_s, held)

    def discard(self) -> None:
        with self._lock:
            self._staged = None
