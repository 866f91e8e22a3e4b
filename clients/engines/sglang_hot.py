"""SGLang's in-place path: a custom weight loader driven by `POST /update_weights_from_tensor`.

How SGLang calls it (sgl-project/sglang, the stored source):

- `python/sglang/srt/entrypoints/http_server.py`: `POST /update_weights_from_tensor`
  takes an `UpdateWeightsFromTensorReqInput` (`managers/io_struct.py`:
  `serialized_named_tensors`, one entry per TP rank, `load_format`, `flush_cache`,
  `abort_all_requests`, `weight_version`) and answers `{"success", "message"}` (200, or
  400 when not successful).
- `managers/scheduler_update_weights_mixin.py`, `update_weights_from_tensor`: the
  scheduler of each TP rank (one process per rank) deserializes
  `serialized_named_tensors[tp_rank]` with `MultiprocessingSerializer.deserialize`
  (`utils/common.py`: base64-decoded when a string, then a restricted unpickler that
  admits `builtins`, `collections`, `torch.*` and a few more), flushes the cache when
  asked, and waits for every rank (a barrier on the TP CPU group) before answering.
- `model_executor/model_runner.py`, `ModelRunner.update_weights_from_tensor(named_tensors,
  load_format)`: every value goes through `_unwrap_tensor` (`.to(device)`), then, when
  `load_format in server_args.custom_weight_loader`, `dynamic_import(load_format)`
  (`"package.module.function"`, split at the last dot) is called as
  `custom_loader(self.model, named_tensors)`. Nothing catches what the loader raises: it
  reaches the scheduler's loop, which stops the server.
- `server_args.py`: `--custom-weight-loader` (a list of import paths).

Launch SGLang with `--custom-weight-loader deltaboard.clients.engines.sglang_hot.load_hot_patch`
(deltaboard installed in its environment, the patch files on the node's disk).

**Encoding.** Each request carries one named tensor: its name is the action
(`deltaboard.stage`, `deltaboard.commit`, `deltaboard.discard`), its value the action's
argument: the UTF-8 path of a patch file written by `write_patch` (stage), the version
(commit). Why a path and not the changes themselves: every rank reads the file from the
node's disk (sidecar and engine share it already, the disk path reloads from it), so the
request is a few hundred bytes whatever the patch size, with no base64 pickles of
position and bit arrays through HTTP, and the file's format is versioned. Why a tensor:
`_unwrap_tensor` calls `.to(device)` on every value. The payload is a plain pickle of one
CPU tensor, not `ForkingPickler`'s (which would pass the tensor as a shared-memory handle
valid only while the sending process holds it): it names only `torch._utils`,
`torch.storage` and `collections`, which SGLang's restricted unpickler admits.

**Two requests**, so that TP ranks agree (`fused_view`): the stage request makes each
rank write its verdict next to the patch (`{patch}.rank{r}.json`: the HTTP answer is
the same on success whatever the loader did); the sidecar commits only when every
verdict is ok, and discards otherwise, so a patch that does not fit leaves every rank's
weights as they were and the server running. A commit that fails raises out of the
loader (weights restored on that rank) and, as above, stops the server: it never serves a
half-applied version.

Not covered: pipeline parallelism, DP attention, quantized or MoE layers (the stage
refuses what the fused layout does not describe).
"""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path
from typing import Any

import torch

from deltaboard.clients.engines import fused_view
from deltaboard.clients.engines.base import EngineAdapterError
from deltaboard.clients.engines.fused_view import Post, Verdict, check_verdicts

LOAD_FORMAT = "deltaboard.clients.engines.sglang_hot.load_hot_patch"
STAGE, COMMIT, DISCARD = "deltaboard.stage", "deltaboard.commit", "deltaboard.discard"


def load_hot_patch(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """The custom weight loader: stage, commit or discard on this TP rank."""
    if len(named_tensors) != 1:
        raise ValueError(f"a deltaboard request carries one named tensor, not {len(named_tensors)}")
    action, value = named_tensors[0]
    tp_size, rank = _tensor_parallel()
    if action == STAGE:
        path = Path(value.cpu().numpy().tobytes().decode())
        verdict = fused_view.stage_file(model, path, tp_size, rank)
        _write_verdict(verdict_path(path, rank), verdict)
    elif action == COMMIT:
        fused_view.commit(model, int(value.cpu().item()))
    elif action == DISCARD:
        fused_view.discard(model)
    else:
        raise ValueError(f"unknown deltaboard action {action!r}")


def _tensor_parallel() -> tuple[int, int]:
    """(TP size, this rank) from SGLang's parallel state, as its own model loaders read it."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return int(get_tensor_model_parallel_world_size()), int(get_tensor_model_parallel_rank())


def verdict_path(patch_path: Path, rank: int) -> Path:
    return patch_path.with_name(f"{patch_path.name}.rank{rank}.json")


def _write_verdict(path: Path, verdict: Verdict) -> None:
    """Atomically (the sidecar reads all of it or none)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(verdict.to_json()))
    tmp.replace(path)


def update_body(
    action: str, value: torch.Tensor, tp_size: int, *, flush_cache: bool, weight_version: int | None
) -> dict[str, Any]:
    """The JSON body of `POST /update_weights_from_tensor` for one action on every rank."""
    payload = base64.b64encode(pickle.dumps([(action, value.cpu())])).decode()
    return {
        "serialized_named_tensors": [payload] * tp_size,
        "load_format": LOAD_FORMAT,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
        "weight_version": None if weight_version is None else str(weight_version),
    }


class SGLangHotPath:
    """The sidecar's side: stage, commit or discard a patch file on every TP rank.

    `post` is the adapter's JSON POST (`EngineAdapter._call(...).json()`); `tp_size` the
    server's (`GET /get_server_info` answers it as `tp_size`).
    """

    def __init__(self, post: Post, tp_size: int) -> None:
        self._post = post
        self.tp_size = tp_size

    def stage(self, patch_path: Path, version: int) -> list[Verdict]:
        """Stage the patch on every rank (the engine keeps generating in between its
        batches); `HotPatchRefused`, with every rank discarded, unless all staged it."""
        for rank in range(self.tp_size):
            verdict_path(patch_path, rank).unlink(missing_ok=True)
        path = torch.frombuffer(bytearray(str(patch_path).encode()), dtype=torch.uint8)
        self._update(STAGE, path, flush_cache=False, weight_version=None)
        verdicts = [self._verdict(patch_path, rank) for rank in range(self.tp_size)]
        try:
            check_verdicts(verdicts, self.tp_size, version)
        except fused_view.HotPatchRefused:
            self.discard()
            raise
        return verdicts

    def commit(self, version: int, *, flush_cache: bool) -> None:
        """Swap the staged version in on every rank; SGLang tags it `weight_version`."""
        self._update(COMMIT, torch.tensor([version]), flush_cache=flush_cache, weight_version=version)

    def discard(self) -> None:
        self._update(DISCARD, torch.empty(0, dtype=torch.uint8), flush_cache=False, weight_version=None)

    def _update(
        self, action: str, value: torch.Tensor, *, flush_cache: bool, weight_version: int | None
    ) -> None:
        body = update_body(
            action, value, self.tp_size, flush_cache=flush_cache, weight_version=weight_version
        )
        answer = self._post("/update_weights_from_tensor", body)
        if not answer.get("success", False):
            raise EngineAdapterError(f"sglang refused {action}: {answer.get('message', answer)}")

    def _verdict(self, patch_path: Path, rank: int) -> Verdict:
        try:
            return Verdict.from_json(json.loads(verdict_path(patch_path, rank).read_text()))
        except FileNotFoundError:
            return Verdict(rank, False, None, 0, "the rank wrote no verdict: is the loader registered?")
