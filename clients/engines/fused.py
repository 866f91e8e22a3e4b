"""Hugging Face tensor names -> an engine's fused, tensor-parallel parameters (Llama, Qwen2).

A patch names Hugging Face tensors (`model.layers.3.self_attn.k_proj.weight`) and flat
positions in them; SGLang and vLLM hold those weights fused and sharded over their
tensor-parallel (TP) ranks. Both engines lay Llama and Qwen2 out the same way, which this
module states once, as a `Placement` per tensor and rank: the block of the Hugging Face
tensor (seen as a matrix) that the rank holds, and where that block starts in the rank's
local parameter. Mapping a patch is then arithmetic on positions (`Layout.shard`), and
building a rank's parameters from a state dict is a copy of those blocks (`Layout.build`).

The layout, read from the engines' source (sgl-project/sglang, vllm-project/vllm):

- q/k/v -> `qkv_proj` and gate/up -> `gate_up_proj`: `stacked_params_mapping` in
  `LlamaForCausalLM.load_weights` (sglang `python/sglang/srt/models/llama.py`; vLLM's
  `packed_modules_mapping` in `vllm/model_executor/models/llama.py` and `qwen2.py` says
  the same). Shards are stacked along the output rows in that order.
- Column-parallel (`QKVParallelLinear`, `MergedColumnParallelLinear`, their biases): rank
  r holds rows `[r * n / T, (r + 1) * n / T)` of each shard. K and V follow
  `QKVParallelLinear.weight_loader` (sglang `python/sglang/srt/layers/linear.py`, the
  same in vLLM `vllm/model_executor/layers/linear.py`): with T > num_kv_heads each rank
  holds one KV head, number `r // (T // num_kv_heads)` (heads are replicated).
- Row-parallel (`RowParallelLinear`: `o_proj`, `down_proj`): rank r holds the columns
  `[r * n / T, (r + 1) * n / T)` (`input_dim` 1); its bias is replicated.
- `VocabParallelEmbedding` / `ParallelLMHead` (`vocab_parallel_embedding.py` in both):
  the vocabulary is padded to a multiple of 64 (`DEFAULT_VOCAB_PADDING_SIZE`), each rank
  holds `padded / T` rows starting at `r * padded / T`, of which those below the real
  vocabulary are weights and the rest zeros (`weight_loader` fills them with 0). A tied
  `lm_head.weight` is the embedding itself: both engines skip the name when loading.
- Norms are replicated.

Pure: numpy and the patch form only, no engine import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from deltaboard.clients.resident.patch import HotPatch, TensorPatch

DEFAULT_VOCAB_PADDING = 64
_LINEAR = re.compile(
    r"model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)"
)
_NORM = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight")
_FUSED = {
    "q_proj": "self_attn.qkv_proj",
    "k_proj": "self_attn.qkv_proj",
    "v_proj": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_up_proj",
    "up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
}


@dataclass(frozen=True)
class ModelDims:
    """What the layout depends on, from a Llama or Qwen2 `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    vocab_padding: int = DEFAULT_VOCAB_PADDING

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelDims:
        """From a config dict (`config.json`, or `PretrainedConfig.to_dict()`): Llama's
        `attention_bias` puts biases on q/k/v and o; Qwen2 has q/k/v biases only."""
        kind = config.get("model_type")
        if kind not in ("llama", "qwen2"):
            raise ValueError(f"hot patches know the fused layout of llama and qwen2 models, not {kind!r}")
        if config.get("mlp_bias"):
            raise ValueError("the engines' Llama MLP has no bias: a model with mlp_bias cannot be served")
        heads = int(config["num_attention_heads"])
        bias = bool(config.get("attention_bias")) if kind == "llama" else True
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias and kind == "llama",
        )

    @property
    def padded_vocab(self) -> int:
        pad = self.vocab_padding
        return (self.vocab_size + pad - 1) // pad * pad


@dataclass(frozen=True)
class Placement:
    """Rank's share of one Hugging Face tensor: rows `rows` and columns `cols` of the
    tensor seen as a matrix (a 1-D tensor of n elements is n x 1) are the block of the
    local parameter `param` (of shape `param_shape`) that starts at row `dst_row`."""

    name: str
    shape: tuple[int, ...]
    param: str
    param_shape: tuple[int, ...]
    rows: tuple[int, int]
    cols: tuple[int, int]
    dst_row: int

    @property
    def columns(self) -> int:
        """Columns of the Hugging Face tensor as a matrix."""
        return self.shape[1] if len(self.shape) == 2 else 1

    @property
    def param_columns(self) -> int:
        return self.param_shape[1] if len(self.param_shape) == 2 else 1

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`(which, where)`: the indices into `positions` (flat, in the Hugging Face
        tensor) of the elements this rank holds, and their flat positions in its local
        parameter. Increasing positions map to increasing positions."""
        row, col = np.divmod(positions.astype(np.int64, copy=False), self.columns)
        (r0, r1), (c0, c1) = self.rows, self.cols
        which = np.flatnonzero((row >= r0) & (row < r1) & (col >= c0) & (col < c1))
        where = (row[which] - r0 + self.dst_row) * self.param_columns + (col[which] - c0)
        return which, where


class Layout:
    """The fused, sharded parameters of TP rank `rank` of `tp_size`, for a model of `dims`.

    Raises `ValueError` for a TP size the engines refuse (heads, KV heads, the MLP width
    or the padded vocabulary not divisible as their layers assert).
    """

    def __init__(self, dims: ModelDims, tp_size: int, rank: int) -> None:
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is not in a TP group of {tp_size}")
        kv_ok = dims.num_kv_heads % tp_size == 0 or tp_size % dims.num_kv_heads == 0
        if dims.num_heads % tp_size or not kv_ok or dims.intermediate_size % tp_size:
            raise ValueError(
                f"TP {tp_size} does not divide {dims.num_heads} heads / {dims.num_kv_heads} KV heads / "
                f"an MLP of {dims.intermediate_size}"
            )
        if dims.padded_vocab % tp_size:
            raise ValueError(f"TP {tp_size} does not divide the padded vocabulary of {dims.padded_vocab}")
        self.dims, self.tp_size, self.rank = dims, tp_size, rank
        self._q = dims.num_heads // tp_size * dims.head_dim
        self._kv = max(1, dims.num_kv_heads // tp_size) * dims.head_dim
        self._kv_shard = rank // max(1, tp_size // dims.num_kv_heads)
        self._mlp = dims.intermediate_size // tp_size
        self._vocab = dims.padded_vocab // tp_size

    def names(self) -> list[str]:
        """Every Hugging Face tensor name the engine loads, in a stable order."""
        d = self.dims
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not d.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names.append(f"{p}self_attn.{proj}.weight")
                if self._has(proj, "bias"):
                    names.append(f"{p}self_attn.{proj}.bias")
            names += [f"{p}mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
        return names

    def place(self, name: str) -> Placement | None:
        """Where this rank holds `name`; None for a tied `lm_head.weight` (the engines
        skip it: it is the embedding). `ValueError` for a name the model does not have."""
        d, h = self.dims, self.dims.hidden_size
        if name == "lm_head.weight" and d.tie_word_embeddings:
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start = self.rank * self._vocab
            rows = (min(start, d.vocab_size), min(start + self._vocab, d.vocab_size))
            return Placement(name, (d.vocab_size, h), name, (self._vocab, h), rows, (0, h), 0)
        norm = _NORM.fullmatch(name)
        if name == "model.norm.weight" or (norm and int(norm[1]) < d.num_layers):
            return Placement(name, (h,), name, (h,), (0, h), (0, 1), 0)
        linear = _LINEAR.fullmatch(name)
        if not linear or int(linear[1]) >= d.num_layers or not self._has(linear[2], linear[3]):
            raise ValueError(f"{name!r} is not a tensor of this {d.num_layers}-layer model")
        layer, proj, kind = linear[1], linear[2], linear[3]
        param = f"model.layers.{layer}.{_FUSED[proj]}.{kind}"
        if proj in ("o_proj", "down_proj"):
            width = self._q if proj == "o_proj" else self._mlp
            full = width * self.tp_size
            if kind == "bias":
                return Placement(name, (h,), param, (h,), (0, h), (0, 1), 0)
            cols = (self.rank * width, (self.rank + 1) * width)
            return Placement(name, (h, full), param, (h, width), (0, h), cols, 0)
        full, size, shard, offset, fused = self._column(proj)
        rows = (shard * size, (shard + 1) * size)
        if kind == "bias":
            return Placement(name, (full,), param, (fused,), rows, (0, 1), offset)
        return Placement(name, (full, h), param, (fused, h), rows, (0, h), offset)

    def _has(self, proj: str, kind: str) -> bool:
        """Whether the model has this projection's `kind` (weight or bias)."""
        if kind == "weight":
            return True
        if proj == "o_proj":
            return self.dims.o_bias
        return proj in ("q_proj", "k_proj", "v_proj") and self.dims.qkv_bias

    def _column(self, proj: str) -> tuple[int, int, int, int, int]:
        """(the tensor's rows, rows per rank, which shard of them this rank holds, its
        row offset in the fused parameter, the fused parameter's rows) of a
        column-parallel projection."""
        d, q, kv, mlp, r = self.dims, self._q, self._kv, self._mlp, self.rank
        heads, kv_heads = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        return {
            "q_proj": (heads, q, r, 0, q + 2 * kv),
            "k_proj": (kv_heads, kv, self._kv_shard, q, q + 2 * kv),
            "v_proj": (kv_heads, kv, self._kv_shard, q + kv, q + 2 * kv),
            "gate_proj": (d.intermediate_size, mlp, r, 0, 2 * mlp),
            "up_proj": (d.intermediate_size, mlp, r, mlp, 2 * mlp),
        }[proj]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every local parameter this rank holds, and its shape."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name in self.names():
            p = self.place(name)
            if p is not None:
                shapes[p.param] = p.param_shape
        return shapes

    def build(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This rank's parameters from a full Hugging Face state dict (arrays of any
        dtype, bit patterns included), zeros where the vocabulary is padded."""
        out: dict[str, np.ndarray] = {}
        for name in self.names():
            if name not in state:
                raise ValueError(f"the state dict has no {name!r}")
            p = self.place(name)
            if p is None:
                continue
            tensor = state[name]
            if tuple(tensor.shape) != p.shape:
                raise ValueError(f"{name!r} is {tuple(tensor.shape)}; the model's config says {p.shape}")
            target = out.setdefault(p.param, np.zeros(p.param_shape, dtype=tensor.dtype))
            (r0, r1), (c0, c1) = p.rows, p.cols
            block = tensor.reshape(-1, p.columns)[r0:r1, c0:c1]
            target.reshape(-1, p.param_columns)[p.dst_row : p.dst_row + r1 - r0, : c1 - c0] = block
        return out

    def shard(self, patch: HotPatch) -> HotPatch:
        """The part of `patch` (by Hugging Face name) this rank holds, by local parameter
        name and position: one `TensorPatch` per changed parameter, positions increasing."""
        parts: dict[str, list[tuple[TensorPatch, np.ndarray, np.ndarray]]] = {}
        numels: dict[str, int] = {}
        for t in patch.tensors():
            p = self.place(t.name)
            if p is None:
                continue
            if t.numel != prod(p.shape):
                raise ValueError(f"{t.name!r} has {t.numel} elements in the patch; the config says {p.shape}")
            which, where = p.locate(t.positions)
            if which.size:
                parts.setdefault(p.param, []).append((t, which, where))
                numels[p.param] = prod(p.param_shape)
        local = []
        for param, pieces in parts.items():
            dtypes = {t.dtype for t, _, _ in pieces}
            if len(dtypes) > 1:
                raise ValueError(f"the patch changes {param!r} in several dtypes: {sorted(dtypes)}")
            where = np.concatenate([w for _, _, w in pieces])
            order = np.argsort(where, kind="stable")
            old = np.concatenate([t.old_bits[which] for t, which, _ in pieces])[order]
            new = np.concatenate([t.new_bits[which] for t, which, _ in pieces])[order]
            local.append(TensorPatch(param, dtypes.pop(), numels[param], where[order], old, new))
        return HotPatch.from_tensors(patch.base_version, patch.version, local)
