"""Tiny real transformers models and their weights in the engines' fused, TP-sharded layout.

`tiny_llama` and `tiny_qwen2` are built from configs with random weights (no download),
in bf16. Their vocabularies are not multiples of 64, so that the engines' vocabulary
padding shows; the Qwen2 model has one KV head (replicated at TP 2), q/k/v biases and a
tied output head, the Llama model two KV heads and its own head.

`rank_models` holds what each TP rank of SGLang or vLLM would hold: a module whose
`named_parameters()` are the engine's names and local shapes (`qkv_proj`, `gate_up_proj`,
the vocabulary shards) and whose `config` is the Hugging Face config, as on the engines'
models. `tp_logits` runs those weights the way T ranks do, so a test can check the
layout against the transformers model itself.

Each engine rank runs in its own process and reads its rank from its parallel state
(`sglang.srt.distributed`, `vllm.distributed`); `install_parallel_state` stands those
modules in for the test, and `as_rank` says which rank is running.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from deltaboard.clients.engines.fused import Layout, ModelDims

_SHAPE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def tiny_llama(seed: int = 0) -> PreTrainedModel:
    config = LlamaConfig(vocab_size=100, num_key_value_heads=2, tie_word_embeddings=False, **_SHAPE)
    return _random(config, seed)


def tiny_qwen2(seed: int = 0) -> PreTrainedModel:
    config = Qwen2Config(vocab_size=90, num_key_value_heads=1, tie_word_embeddings=True, **_SHAPE)
    model = _random(config, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # initialized to zeros: make them matter
                p.normal_(0.0, 0.02)
    return model


def _random(config: Any, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    return model


def view_bits(model: PreTrainedModel) -> dict[str, np.ndarray]:
    """The published view as bf16 bit patterns, in the tensors' own shapes: a tied output
    head is left out, as `save_pretrained` and the publisher leave it out."""
    tied = model.config.tie_word_embeddings
    return {
        n: t.detach().contiguous().view(torch.int16).numpy().view(np.uint16).copy()
        for n, t in model.state_dict().items()
        if not (tied and n == "lm_head.weight")
    }


def dims_of(model: torch.nn.Module) -> ModelDims:
    """The layout's dimensions from a model's Hugging Face config (a transformers model,
    or an engine rank's)."""
    config: Any = model.config
    return ModelDims.from_config(config.to_dict())


class FusedModel(torch.nn.Module):
    """One rank's model: parameters under the engine's names, and the HF config."""

    def __init__(self, config: Any, params: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        for name, value in params.items():
            *path, leaf = name.split(".")
            module: torch.nn.Module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, torch.nn.Module())
                child = module._modules[part]
                assert child is not None
                module = child
            module.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))

    def bits(self) -> dict[str, np.ndarray]:
        """Every parameter's bf16 bit patterns (a copy)."""
        return {
            n: p.detach().view(torch.int16).numpy().view(np.uint16).copy() for n, p in self.named_parameters()
        }


def rank_models(model: PreTrainedModel, view: Mapping[str, np.ndarray], tp_size: int) -> list[FusedModel]:
    """The TP ranks' models, loaded from `view` (bf16 bits) as the engines load a checkpoint."""
    dims = dims_of(model)
    ranks = []
    for rank in range(tp_size):
        params = Layout(dims, tp_size, rank).build(view)
        tensors = {n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for n, a in params.items()}
        ranks.append(FusedModel(model.config, tensors))
    return ranks


def tp_logits(ranks: Sequence[FusedModel], model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one sequence `ids` computed from the ranks' weights as T ranks compute
    them (in float32): column-parallel outputs stay on their rank, row-parallel partial
    sums and the vocabulary-sharded embedding are summed (the all-reduce), the sharded
    logits concatenated (the all-gather) and the padding cut. Rotary embedding and the
    norm's epsilon come from the transformers model."""
    dims, eps = dims_of(model), float(model.config.rms_norm_eps)
    p = [{n: t.detach().float() for n, t in m.named_parameters()} for m in ranks]
    t, hd, per = len(ranks), dims.head_dim, dims.padded_vocab // len(ranks)

    def embed(w: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        held = (local >= 0) & (local < per)
        return w[local.clamp(0, per - 1)] * held[:, None]

    h = sum(embed(p[r]["model.embed_tokens.weight"], ids - r * per) for r in range(t))
    assert isinstance(h, torch.Tensor)
    cos, sin = model.model.rotary_emb(h[None], torch.arange(ids.numel())[None])
    causal = torch.full((ids.numel(), ids.numel()), float("-inf")).triu(1)
    q_rows, kv_rows = dims.num_heads // t * hd, max(1, dims.num_kv_heads // t) * hd
    for i in range(dims.num_layers):
        pre = f"model.layers.{i}."
        x, attn = _rms(h, p[0][pre + "input_layernorm.weight"], eps), torch.zeros_like(h)
        for r in range(t):
            qkv = x @ p[r][pre + "self_attn.qkv_proj.weight"].T + p[r].get(
                pre + "self_attn.qkv_proj.bias", 0.0
            )
            q, k, v = (
                part.view(ids.numel(), -1, hd).transpose(0, 1)
                for part in torch.split(qkv, [q_rows, kv_rows, kv_rows], -1)
            )
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            group = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            weights = torch.softmax(q @ k.transpose(-1, -2) * hd**-0.5 + causal, -1)
            attn += (weights @ v).transpose(0, 1).reshape(ids.numel(), -1) @ p[r][
                pre + "self_attn.o_proj.weight"
            ].T
        h = h + attn + p[0].get(pre + "self_attn.o_proj.bias", 0.0)
        x, mlp = _rms(h, p[0][pre + "post_attention_layernorm.weight"], eps), torch.zeros_like(h)
        for r in range(t):
            gate, up = (x @ p[r][pre + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
            mlp += (torch.nn.functional.silu(gate) * up) @ p[r][pre + "mlp.down_proj.weight"].T
        h = h + mlp
    h = _rms(h, p[0]["model.norm.weight"], eps)
    head = "model.embed_tokens.weight" if dims.tie_word_embeddings else "lm_head.weight"
    return torch.cat([h @ p[r][head].T for r in range(t)], -1)[:, : dims.vocab_size]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, -1)
    return x * cos + torch.cat((-second, first), -1) * sin


_RANK: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("tensor_parallel")


@contextmanager
def as_rank(tp_size: int, rank: int) -> Iterator[None]:
    """Run as TP rank `rank` of `tp_size` (what each engine process is, in its own state)."""
    token = _RANK.set((tp_size, rank))
    try:
        yield
    finally:
        _RANK.reset(token)


def install_parallel_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand in `sglang.srt.distributed` and `vllm.distributed` for this test: the two
    functions both engines' loaders read their TP rank and size from."""
    functions: dict[str, Callable[[], int]] = {
        "get_tensor_model_parallel_rank": lambda: _RANK.get()[1],
        "get_tensor_model_parallel_world_size": lambda: _RANK.get()[0],
    }
    for package in ("sglang", "sglang.srt", "vllm"):
        monkeypatch.setitem(sys.modules, package, ModuleType(package))
    for name in ("sglang.srt.distributed", "vllm.distributed"):
        module = ModuleType(name)
        for attr, fn in functions.items():
            setattr(module, attr, fn)
        monkeypatch.setitem(sys.modules, name, module)
