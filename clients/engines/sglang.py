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
- `GET /get_model_info`: `model_path` (set by every successful `update_weights_from_disk`)
  and `weight_version` (set when the update names one): the adapter's `EngineStamp`;
- `GET /health`.

SGLang keeps no load counter, so the stamp tells loads apart by version label and path:
a foreign load from another directory or under another label shows, a reload of the same
directory under the same label (the same bytes) does not. The sidecar asks
`/get_model_info` after each response (SGLang's responses carry no stamp).

Inference routes (what the sidecar proxies), from the same file: the OpenAI-compatible
`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/v1/embeddings`,
`/v1/classify`, `/v1/score`, `/v1/rerank`, `/v1/responses`, `/v1/tokenize`,
`/v1/detokenize`, and the native `/generate`, `/encode`, `/classify`, `/tokenize`,
`/detokenize`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaboard.clients.engines.base import (
    CommitMode,
    EngineAdapter,
    EngineAdapterError,
    EngineStamp,
    HotCommitted,
)
from deltaboard.clients.engines.fused_adapter import FusedHotAdapter

INFERENCE_POSTS = (
    "/v1/embeddings",
    "/v1/classify",
    "/v1/score",
    "/v1/rerank",
    "/v1/responses",
    "/v1/tokenize",
    "/v1/detokenize",
    "/generate",
    "/encode",
    "/classify",
    "/tokenize",
    "/detokenize",
)


class SGLangAdapter(FusedHotAdapter):
    kind = "sglang"
    inference_routes = EngineAdapter.inference_routes | {("POST", path) for path in INFERENCE_POSTS}
    stamp_path = "/get_model_info"
    source_field = "model_path"

    def _hold(self) -> None:
        self._call("POST", "/pause_generation", json={"mode": "in_place"})

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> EngineStamp:
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
        return self.loaded()

    def _release(self) -> None:
        self._call("POST", "/continue_generation", json={})

    # The in-place path (`clients.engines.sglang_hot`): SGLang started with
    # `--custom-weight-loader deltaboard.clients.engines.sglang_hot.load_hot_patch`.

    def _hot_path(self) -> Any:
        from deltaboard.clients.engines.sglang_hot import SGLangHotPath

        info = self._call("GET", "/get_server_info").json()
        return SGLangHotPath(self._post_json, int(info.get("tp_size", 1)))

    def commit_patch(self, version: int, mode: CommitMode) -> HotCommitted:
        # In place, running requests wait between two steps and keep their cache.
        hot = self._hot_path()
        pause_ms = self._held(mode, lambda: hot.commit(version, flush_cache=mode == "quiesce"))
        return HotCommitted(self.loaded(), pause_ms)
