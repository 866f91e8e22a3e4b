"""Imitations of SGLang's and vLLM's in-place update paths, calling the hooks as they do.

Each is a FastAPI app serving the engine's own route over ranks held in this process
(`fused_models.rank_models`); what each step does, and where the real engines do it:

- SGLang `POST /update_weights_from_tensor` (`entrypoints/http_server.py`): the body is
  parsed into `UpdateWeightsFromTensorReqInput` (`managers/io_struct.py`); each TP rank's
  scheduler (`scheduler_update_weights_mixin.py`) deserializes its own entry of
  `serialized_named_tensors` like `MultiprocessingSerializer.deserialize`
  (`utils/common.py`: base64, then an unpickler that admits only listed modules), and its
  `ModelRunner.update_weights_from_tensor` (`model_executor/model_runner.py`) moves every
  tensor to the device, checks `load_format` against `--custom-weight-loader`, imports it
  with `dynamic_import` and calls `custom_loader(model, named_tensors)`. The answer is
  `{"success", "message"}`; the flush and the `weight_version` tag follow a success. An
  exception from a loader is not caught (SGLang's scheduler would stop the server).
- vLLM: the worker class gets the `--worker-extension-cls` class appended to its bases
  after vLLM's conflict check (`WorkerWrapperBase.init_worker`); `POST /collective_rpc`
  (`entrypoints/serve/dev/rpc/api_router.py`) calls `collective_rpc`, which runs
  `run_method(worker, method, args, kwargs)` (`v1/serial_utils.py`) on every worker in
  rank order and answers `{"results": [...]}`.

Every rank's call runs under `fused_models.as_rank`, as each engine process would.
"""

from __future__ import annotations

import base64
import importlib
import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from tests.services.fakes.fused_models import FusedModel, as_rank

# Modules SGLang's restricted unpickler admits (utils/common.py, SafeUnpickler), as far
# as a payload of named tensors can need them.
_ALLOWED = (
    "builtins.",
    "collections.",
    "copyreg.",
    "functools.",
    "itertools.",
    "operator.",
    "types.",
    "torch.",
)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not (module + ".").startswith(_ALLOWED):
            raise pickle.UnpicklingError(f"blocked unpickle of {module}.{name}")
        return super().find_class(module, name)


def deserialize(data: str | bytes) -> Any:
    """`MultiprocessingSerializer.deserialize`."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return _SafeUnpickler(io.BytesIO(data)).load()


def dynamic_import(func_path: str) -> Any:
    """SGLang's `dynamic_import`: `package.module.function`, split at the last dot."""
    module_path, _, func_name = func_path.rpartition(".")
    if not module_path:
        raise ValueError("func_path should contain both module name and func name (such as 'module.func')")
    return getattr(importlib.import_module(module_path), func_name)


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[str | bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass
class SGLangModelRunner:
    model: FusedModel
    tp_rank: int
    custom_weight_loader: list[str]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], load_format: str | None
    ) -> tuple[bool, str]:
        named_tensors = [(name, tensor.to(self.device)) for name, tensor in named_tensors]
        if load_format in self.custom_weight_loader:
            custom_loader = dynamic_import(load_format)
            custom_loader(self.model, named_tensors)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        return True, "Success"


@dataclass
class SGLangState:
    weight_version: str = "0"
    flushes: int = 0
    calls: list[str] = field(default_factory=list)  # the control routes, in order


def sglang_app(ranks: Sequence[FusedModel], custom_weight_loader: list[str], state: SGLangState) -> FastAPI:
    runners = [SGLangModelRunner(model, rank, custom_weight_loader) for rank, model in enumerate(ranks)]
    app = FastAPI()

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        obj = UpdateWeightsFromTensorReqInput(**await request.json())
        results = []
        for runner in runners:
            with as_rank(len(runners), runner.tp_rank):
                named_tensors = deserialize(obj.serialized_named_tensors[runner.tp_rank])
                results.append(runner.update_weights_from_tensor(named_tensors, obj.load_format))
        success, message = results[0]
        if success and obj.flush_cache:
            state.flushes += 1
        if success and obj.weight_version is not None:
            state.weight_version = obj.weight_version
        state.calls.append("update_weights_from_tensor")
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    # The control routes an adapter drives around an update (`http_server.py`).
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {"tp_size": len(runners)}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": "/models/policy", "weight_version": state.weight_version}

    @app.post("/pause_generation")
    async def pause_generation() -> dict[str, Any]:
        state.calls.append("pause_generation")
        return {}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        state.calls.append("continue_generation")
        return {}

    return app


class VLLMModelRunner:
    def __init__(self, model: FusedModel) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


class VLLMWorker:
    """The worker's own surface, against which vLLM checks an extension for conflicts."""

    def __init__(self, model: FusedModel, rank: int) -> None:
        self.model_runner = VLLMModelRunner(model)
        self.rank = rank

    def get_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def load_model(self) -> None:
        raise NotImplementedError

    def execute_model(self, scheduler_output: Any) -> Any:
        raise NotImplementedError

    def reload_weights(self) -> None:
        raise NotImplementedError


def resolve_obj_by_qualname(qualname: str) -> Any:
    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)


def extended_worker_class(worker_extension_cls: str) -> type[VLLMWorker]:
    """A fresh worker class (vLLM changes the class itself) with the extension appended."""
    worker_class = type("Worker", (VLLMWorker,), {})
    extension = resolve_obj_by_qualname(worker_extension_cls)
    for attr in dir(extension):
        if attr.startswith("__"):
            continue
        assert not hasattr(worker_class, attr), f"{worker_class} already has {attr}"
    worker_class.__bases__ = (*worker_class.__bases__, extension)
    return worker_class


def run_method(obj: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        func = getattr(obj, method)
    except AttributeError:
        raise NotImplementedError(f"Method {method!r} is not implemented.") from None
    return func(*args, **kwargs)


@dataclass
class VLLMState:
    weight_version: str | None = None
    calls: list[str] = field(default_factory=list)  # the control routes, in order


def vllm_app(
    ranks: Sequence[FusedModel], worker_extension_cls: str, state: VLLMState | None = None
) -> FastAPI:
    control = state or VLLMState()
    worker_class = extended_worker_class(worker_extension_cls)
    workers = [worker_class(model, rank) for rank, model in enumerate(ranks)]
    app = FastAPI()

    def collective_rpc(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        results = []
        for worker in workers:
            with as_rank(len(workers), worker.rank):
                results.append(run_method(worker, method, args, kwargs))
        return results

    @app.post("/collective_rpc")
    async def rpc(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("method") is None:
            raise HTTPException(400, "Missing 'method' in request body")
        results = collective_rpc(body["method"], tuple(body.get("args", [])), body.get("kwargs", {}))
        answer = [r if r is None or isinstance(r, dict | list) else str(r) for r in results]
        control.calls.append(f"collective_rpc {body['method']}")
        return JSONResponse({"results": answer})

    # The dev-mode control routes an adapter drives around an update (`serve/dev/rlhf`).

    @app.post("/pause")
    async def pause() -> dict[str, Any]:
        control.calls.append("pause")
        return {}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        control.calls.append("resume")
        return {}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        control.weight_version = (await request.json())["new_version"]
        control.calls.append("update_weight_version")
        return {}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        control.calls.append("reset_prefix_cache")
        return {}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return {"weight_version": control.weight_version}

    return app
