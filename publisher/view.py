"""The rollout view: the exact bytes an inference engine serves, from a trainer state dict.

Floating tensors are cast with `Tensor.to(dtype)`, which rounds to nearest, ties to even,
on CPU and CUDA alike (NaN stays NaN, overflow goes to inf): the same bytes the engine would
get from `model.to(dtype)`. Weights an FP8 block rule names become float8_e4m3fn plus their
`_scale_inv` (`deltaboard.publisher.quantize`). Integer and fp8 tensors, and tensors a
`raw` rule names, pass through untouched. The view stays on the tensors' own device so
that the publisher diffs it there and only moves changed elements to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.board.contract.view_spec import served_dtype
from deltaboard.publisher.quantize import quantize_state

TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
SAFETENSORS_TO_TORCH = {v: k for k, v in TORCH_TO_SAFETENSORS.items()}


def safetensors_dtype(t: torch.Tensor) -> str:
    try:
        return TORCH_TO_SAFETENSORS[t.dtype]
    except KeyError:
        raise ValueError(f"dtype {t.dtype} has no safetensors name") from None


def rollout_view(state_dict: dict[str, torch.Tensor], spec: ViewSpec) -> dict[str, torch.Tensor]:
    """Served tensors by name, contiguous, on each tensor's own device.

    A tensor that needs no cast (bf16 parameters in a bf16 view, integers) is returned
    as is, sharing the parameter's memory: copy it before the next optimizer step if it
    must stay the *old* view.
    """
    view: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in quantize_state(state_dict, spec).items():
            target = SAFETENSORS_TO_TORCH[served_dtype(name, safetensors_dtype(t), spec, t.shape)]
            view[name] = t.detach().to(target).contiguous()
    return view


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw little-endian bytes as a 1-D uint8 array on the host.

    Zero-copy for a contiguous CPU tensor: the array shares its memory, so copy it if the
    tensor will change under you.
    """
    flat = t.detach().contiguous().reshape(-1).cpu()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy()
