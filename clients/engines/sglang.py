"""Adapter for SGLang's HTTP server, from its documented RL routes.

SGLang ("SGLang for RL Systems", docs.sglang.io/advanced_features/sglang_for_rl, and
`sglang/srt/entrypoints/http_server.py`):

- `POST /pause_generation {"mode": "in_place"}`: stop scheduling but keep running
  requests and their KV cache (modes `abort` and `retract` also exist);
- `POST /update_weights_from_disk {"model_path", "weight_version", ...}`: load the
  checkpoint at `model_path`; answers `{"success": bool, "message": str}` (HTTP 200 or
  400); `weight_version` tags the engine's reported version; `flush_cache: false` keeps
  the paused requests' cache in in-place mode;
- `POST /continue_generation {}`: resume after a pause;
- `POST /flush_cache` (also GET): drop the radix cache, which a drained engine must do
  after new weights (prefix KV computed with old weights is stale); 400 while requests run;
- `GET /health`.
"""

from __future__ import annotations

from pathlib import Path

from deltaboard.clients.engines.base import CommitMode, EngineAdapter, EngineAdapterError


class SGLangAdapter(EngineAdapter):
    kind = "sglang"

    def _hold(self) -> None:
        self._call("POST", "/pause_generation", json={"mode": "in_place"})

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> None:
        body = {
            "model_path": str(model_dir),
            "weight_version": str(version),
            "abort_all_requests": False,
            "flush_cache": mode == "quiesce",
        }
        answer = self._call("POST", "/update_weights_from_disk", json=body).json()
        if not answer.get("success", False):
            raise EngineAdapterError(f"sglang refused the update: {answer.get('message', answer)}")
        if mode == "quiesce":
            self._call("POST", "/flush_cache")

    def _release(self) -> None:
        self._call("POST", "/continue_generation", json={})
