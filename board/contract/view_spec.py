"""Which dtype each tensor is served in, and how tensors are laid out in shard files.

Pure rules over names, dtypes and shapes (no torch), so the board, the publisher and the
follower agree on them without sharing any tensor. Dtypes are safetensors names.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deltaboard.board.contract.schemas import ViewSpec

FLOATING = frozenset({"F64", "F32", "F16", "BF16"})
_SERVED = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
# Bytes per element of every dtype the codec handles (safetensors names). The codec's
# wire code of a dtype is its position here (`board.codec.dtypes`): append only, never
# reorder.
DTYPE_WIDTHS: dict[str, int] = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def served_dtype(name: str, source_dtype: str, spec: ViewSpec) -> str:
    """The safetensors dtype `name` is served in.

    Floating tensors take the first matching rule's dtype, else the spec's default; `raw`
    rules and every integer or fp8 tensor keep their source dtype (their bytes pass through).
    """
    if source_dtype not in FLOATING:
        return source_dtype
    for rule in spec.rules:
        if fnmatch.fnmatchcase(name, rule.pattern):
            return source_dtype if rule.dtype == "raw" else _SERVED[rule.dtype]
    return _SERVED[spec.default_dtype]


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return DTYPE_WIDTHS[dtype] * math.prod(shape)


@dataclass(frozen=True)
class Layout:
    """Shard files in order, the file of each tensor, and the index JSON (None: one file)."""

    files: tuple[str, ...]
    placement: dict[str, str]
    index: dict[str, Any] | None


def plan_layout(tensors: Sequence[tuple[str, str, tuple[int, ...]]], spec: ViewSpec) -> Layout:
    """Cut (name, served dtype, shape) tensors into shards like `save_pretrained` does.

    Tensors are taken in order; a shard is closed when the next tensor would push it past
    `spec.shard_max_bytes` (a tensor larger than the limit gets a shard of its own).
    """
    groups: list[list[str]] = [[]]
    size = 0
    total = 0
    for name, dtype, shape in tensors:
        b = nbytes(dtype, shape)
        total += b
        if groups[-1] and size + b > spec.shard_max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += b
    if len(groups) == 1:
        return Layout((SINGLE_FILE,), {name: SINGLE_FILE for name in groups[0]}, None)
    n = len(groups)
    files = tuple(f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n))
    placement = {name: files[i] for i, group in enumerate(groups) for name in group}
    index = {"metadata": {"total_size": total}, "weight_map": dict(placement)}
    return Layout(files, placement, index)
