"""What the SGLang and vLLM adapters share on the hot path: the patch file staged on every
tensor-parallel rank through the engine's own extension point, all ranks or none.

Each engine's driver (`sglang_hot.SGLangHotPath`, `vllm_hot.VLLMHotPath`) is imported
on first use: it needs torch, which the sidecar's disk path does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaboard.clients.engines.base import EngineAdapter, HotRefused


class FusedHotAdapter(EngineAdapter):
    def _hot_path(self) -> Any:
        """The engine's driver: `stage(path, version)`, `commit(version, ...)`, `discard()`."""
        raise NotImplementedError

    def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        return self._call("POST", path, json=body).json()

    def stage_patch(self, patch: Path, version: int) -> None:
        from deltaboard.clients.engines.fused_view import HotPatchRefused

        try:
            self._hot_path().stage(patch, version)
        except HotPatchRefused as exc:
            raise HotRefused(f"{self.kind} at {self.url}: {exc}") from exc

    def discard_patch(self) -> None:
        self._hot_path().discard()
