"""Which dtype each tensor is served in, and how tensors are laid out in shard files.

Pure rules over names, dtypes and shapes (no torch), so the board, the publisher and the
follower agree on them without sharing any tensor. Dtypes are safetensors names.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from deltaboard.board.contract.schemas import ViewRule, ViewSpec

FLOATING = frozenset({"F64", "F32", "F16", "BF16"})
_SERVED = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
FP8_BLOCK = "fp8_e4m3_block128"
# The fp32 block scales of an FP8 weight are a tensor of their own, named as Hugging
# Face's `FP8Linear` names its parameter: `...q_proj.weight` -> `...q_proj.weight_scale_inv`.
SCALE_SUFFIX = "_scale_inv"
# Linear layers' weights in Llama/Qwen/Mistral-style models (`q_proj`, `down_proj`, ...)
# and in `fc1`/`fc2` MLPs; embeddings, norms, biases and `lm_head` match none of them.
LINEAR_WEIGHTS = ("*proj.weight", "*fc*.weight")
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


def fp8_view(
    scale: Literal["amax", "ue8m0"] = "amax", patterns: Sequence[str] = LINEAR_WEIGHTS, **fields: Any
) -> ViewSpec:
    """A view serving the 2-D weights that match `patterns` in FP8 with 128x128 block
    scales (rule `scale`), everything else in the spec's default dtype (bf16)."""
    rules = tuple(ViewRule(pattern=p, dtype=FP8_BLOCK, scale=scale) for p in patterns)
    return ViewSpec(rules=rules + tuple(fields.pop("rules", ())), **fields)


def applying_rule(name: str, shape: Sequence[int], spec: ViewSpec) -> ViewRule | None:
    """The first rule that applies to floating tensor `name` of `shape` (FP8 block rules
    apply to 2-D tensors only; other tensors go on to the next rule), None: the default."""
    for rule in spec.rules:
        if fnmatch.fnmatchcase(name, rule.pattern) and (rule.dtype != FP8_BLOCK or len(shape) == 2):
            return rule
    return None


def unmatched_rules(names: Sequence[str], spec: ViewSpec) -> list[ViewRule]:
    """The rules of `spec` whose pattern matches none of `names`: a spec written for
    another model, or a pattern written as a regular expression (`.*` is a glob for the
    names that start with a dot), which would leave tensors in the default dtype without a
    word."""
    return [
        rule for rule in spec.rules if not any(map(re.compile(fnmatch.translate(rule.pattern)).match, names))
    ]


def served_dtype(name: str, source_dtype: str, spec: ViewSpec, shape: Sequence[int] = ()) -> str:
    """The safetensors dtype `name` (of `shape`) is served in.

    Floating tensors take the first applying rule's dtype, else the spec's default; `raw`
    rules and every integer or fp8 tensor keep their source dtype (their bytes pass through).
    An FP8 block rule serves a 2-D weight as F8_E4M3, and the `_scale_inv` beside it as F32,
    so that the served tensors themselves map to their own dtypes again.
    """
    if source_dtype not in FLOATING:
        return source_dtype
    if name.endswith(SCALE_SUFFIX):
        base = applying_rule(name.removesuffix(SCALE_SUFFIX), shape, spec)
        if base is not None and base.dtype == FP8_BLOCK:
            return "F32"
    rule = applying_rule(name, shape, spec)
    if rule is None:
        return _SERVED[spec.default_dtype]
    if rule.dtype == FP8_BLOCK:
        return "F8_E4M3"
    return source_dtype if rule.dtype == "raw" else _SERVED[rule.dtype]


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
