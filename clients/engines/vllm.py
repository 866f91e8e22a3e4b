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
- `POST /resume`, `GET /health`.

(vLLM's `/sleep` / `/wake_up` release GPU memory for colocated training and NCCL
`/update_weights` streams tensors from a trainer; neither fits a node that loads from its
local directory, so this adapter does not use them.)
"""

from __future__ import annotations

from pathlib import Path

from deltaboard.clients.engines.base import CommitMode, EngineAdapter, EngineAdapterError


class VLLMAdapter(EngineAdapter):
    kind = "vllm"

    def _hold(self) -> None:
        self._call("POST", "/pause", params={"mode": "keep"})

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> None:
        # `model_dir` is not sent: vLLM re-reads the path it was started with (the follower's model_dir).
        answer = self._call("POST", "/collective_rpc", json={"method": "reload_weights"})
        if answer.content and "results" not in answer.json():
            raise EngineAdapterError(f"vllm collective_rpc answered {answer.text[:200]}")
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        if mode == "quiesce":
            self._call("POST", "/reset_prefix_cache")

    def _release(self) -> None:
        self._call("POST", "/resume")
