"""Adapter for vLLM's OpenAI server, from its documented development-mode routes.

vLLM exposes its RL control routes only with `VLLM_SERVER_DEV_MODE=1`
(`vllm/entrypoints/serve/dev/rlhf/api_router.py`, `.../dev/rpc/api_router.py`,
docs.vllm.ai "RLHF Http" examples):

- `POST /pause?mode=keep`: freeze running requests in the scheduler until `/resume`
  (`mode=wait` drains them, `mode=abort` drops them);
- `POST /collective_rpc {"method": "reload_weights"}`: every worker re-reads the weights
  from the model path the server was started with. The follower's `model_dir` is a
  stable path, so `vllm serve <model_dir>` plus this call loads each new version from
  disk;
- `POST /update_weight_version {"new_version": "N"}`: tag the served version;
- `POST /reset_prefix_cache`: drop prefix-cache KV computed with the old weights;
- `GET /weight_info`: `{"weight_version"}`, the adapter's `EngineStamp`;
- `POST /resume`, `GET /health`.

vLLM keeps no load counter and always loads the path it was started with, so the stamp
is the version label alone: a foreign `update_weight_version` shows, a foreign
`reload_weights` (which re-reads the follower's directory, the same bytes) does not. The
sidecar asks `/weight_info` after each response (vLLM's responses carry no stamp).

Inference routes (what the sidecar proxies), from `vllm/entrypoints/openai` and
`vllm/entrypoints/serve`: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/v1/embeddings`, `/v1/responses`, `/pooling`, `/classify`, `/score`, `/v1/score`,
`/rerank`, `/v1/rerank`, `/v2/rerank`, `/tokenize`, `/detokenize`.

(vLLM's `/sleep` / `/wake_up` release GPU memory for colocated training and NCCL
`/update_weights` streams tensors from a trainer; neither fits a node that loads from its
local directory, so this adapter does not use them.)
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
    "/v1/responses",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/tokenize",
    "/detokenize",
)


class VLLMAdapter(FusedHotAdapter):
    kind = "vllm"
    inference_routes = EngineAdapter.inference_routes | {("POST", path) for path in INFERENCE_POSTS}
    stamp_path = "/weight_info"

    def _hold(self) -> None:
        self._call("POST", "/pause", params={"mode": "keep"})

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> EngineStamp:
        # `model_dir` is not sent: vLLM re-reads the path it was started with (the follower's model_dir).
        answer = self._call("POST", "/collective_rpc", json={"method": "reload_weights"})
        if answer.content and "results" not in answer.json():
            raise EngineAdapterError(f"vllm collective_rpc answered {answer.text[:200]}")
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        if mode == "quiesce":
            self._call("POST", "/reset_prefix_cache")
        return self.loaded()

    def _release(self) -> None:
        self._call("POST", "/resume")

    # The in-place path (`clients.engines.vllm_hot`): vLLM started with
    # `--worker-extension-cls deltaboard.clients.engines.vllm_hot.DeltaboardWorkerExtension`.

    def _hot_path(self) -> Any:
        from deltaboard.clients.engines.vllm_hot import VLLMHotPath

        return VLLMHotPath(self._post_json)

    def commit_patch(self, version: int, mode: CommitMode) -> HotCommitted:
        hot = self._hot_path()
        pause_ms = self._held(mode, lambda: hot.commit(version))
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        if mode == "quiesce":
            self._call("POST", "/reset_prefix_cache")
        return HotCommitted(self.loaded(), pause_ms)
