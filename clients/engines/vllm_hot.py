"""vLLM's in-place path: a worker extension driven by `POST /collective_rpc`.

How vLLM calls it (vllm-project/vllm, the stored source):

- `--worker-extension-cls` (`ParallelConfig.worker_extension_cls`):
  `WorkerWrapperBase.init_worker` (`vllm/v1/worker/worker_base.py`)
  resolves the qualified name, refuses it if any of its non-dunder attributes is already
  a worker attribute, and appends it to the worker class's `__bases__`: its methods run
  on the worker, in each worker process (one per TP rank).
- `collective_rpc(method, timeout, args, kwargs)` runs `run_method(worker, method, args,
  kwargs)` (`vllm/v1/serial_utils.py`: a string method is `getattr(worker, method)`) on
  every worker and returns their results in rank order.
- `POST /collective_rpc` (`vllm/entrypoints/serve/dev/rpc/api_router.py`, with
  `VLLM_SERVER_DEV_MODE=1`): `{"method", "args", "kwargs", "timeout"}`, args and kwargs
  as strings "for security reason"; answers `{"results": [...]}`, a result that is not
  None, a dict or a list as its `str`.
- The worker's model is `Worker.get_model()` (`model_runner.get_model()`, unwrapped from
  CUDA-graph wrappers), its TP rank and size `vllm.distributed`'s
  `get_tensor_model_parallel_rank` / `_world_size`, as vLLM's model loaders read them.

Launch: `VLLM_SERVER_DEV_MODE=1 vllm serve ... --worker-extension-cls
deltaboard.clients.engines.vllm_hot.DeltaboardWorkerExtension`. The sidecar stages
(`deltaboard_stage(patch_path)`, every rank answers a verdict), commits between
`/pause?mode=keep` and `/resume` (`deltaboard_commit(version)`), then tags the version
with `/update_weight_version`; it discards (`deltaboard_discard`) when a verdict is not
ok. See `fused_view` for what each step checks.

Why not the weight-transfer engine (`vllm/distributed/weight_transfer/`: a backend with
`init_transfer_engine`, `start_weight_update`, `update_weights` / `receive_weights`,
`finish_weight_update`, created by `WeightTransferEngineFactory`): in the stored source
its constructor changed from `(config, parallel_config)` to `(config, vllm_config,
device, model)`, `WeightTransferConfig.backend` is a `Literal` of the built-in backends
in one version, and a custom backend must be registered in every worker process before
the engine is created (a vLLM general plugin), while the worker extension is named on
the command line and has kept its contract. The backends are built to receive tensors
from a trainer over NCCL or IPC; the sparse one (`sparse_nccl_engine.py`) is TP=1 only
and writes without checking the old values. A patch file on the node's disk, staged and
committed on every rank with a verdict in between, fits the extension.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from deltaboard.clients.engines import fused_view
from deltaboard.clients.engines.base import EngineAdapterError
from deltaboard.clients.engines.fused_view import Post, Verdict, check_verdicts

EXTENSION = "deltaboard.clients.engines.vllm_hot.DeltaboardWorkerExtension"


class _Worker(Protocol):
    def get_model(self) -> torch.nn.Module: ...


class DeltaboardWorkerExtension:
    """Mixed into vLLM's worker class; every name starts with `deltaboard_`, so that it
    cannot collide with the worker's own (vLLM refuses a collision)."""

    def deltaboard_stage(self: _Worker, patch_path: str) -> dict[str, Any]:
        tp_size, rank = _tensor_parallel()
        return fused_view.stage_file(self.get_model(), Path(patch_path), tp_size, rank).to_json()

    def deltaboard_commit(self: _Worker, version: str) -> dict[str, Any]:
        report = fused_view.commit(self.get_model(), int(version))
        return {"version": report.version, "changed": report.changed, "pause_ms": report.pause_s * 1e3}

    def deltaboard_discard(self: _Worker) -> None:
        fused_view.discard(self.get_model())


def _tensor_parallel() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return int(get_tensor_model_parallel_world_size()), int(get_tensor_model_parallel_rank())


def rpc_body(method: str, *args: str) -> dict[str, Any]:
    """The JSON body of `POST /collective_rpc` (arguments travel as strings)."""
    return {"method": method, "args": list(args)}


class VLLMHotPath:
    """The sidecar's side: stage, commit or discard a patch file on every worker.

    `post` is the adapter's JSON POST (`EngineAdapter._call(...).json()`).
    """

    def __init__(self, post: Post) -> None:
        self._post = post

    def stage(self, patch_path: Path, version: int) -> list[Verdict]:
        """`HotPatchRefused`, with every worker discarded, unless all staged `version`."""
        results = self._rpc("deltaboard_stage", str(patch_path))
        try:
            if not all(isinstance(r, dict) for r in results):
                raise EngineAdapterError(f"vllm workers answered {results!r}: is the extension loaded?")
            verdicts = [Verdict.from_json(r) for r in results]
            check_verdicts(verdicts, len(verdicts), version)
        except (EngineAdapterError, fused_view.HotPatchRefused):
            self.discard()
            raise
        return verdicts

    def commit(self, version: int) -> list[dict[str, Any]]:
        """Swap the staged version in on every worker; their reports, in rank order."""
        results = self._rpc("deltaboard_commit", str(version))
        if not all(isinstance(r, dict) and r.get("version") == version for r in results):
            raise EngineAdapterError(f"vllm workers answered the commit of {version} with {results!r}")
        return results

    def discard(self) -> None:
        self._rpc("deltaboard_discard")

    def _rpc(self, method: str, *args: str) -> list[Any]:
        answer = self._post("/collective_rpc", rpc_body(method, *args))
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise EngineAdapterError(f"vllm collective_rpc {method} answered {answer!r}")
        return results
