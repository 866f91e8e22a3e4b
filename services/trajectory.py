"""Training trajectories of a small causal LM, for benchmarks and end-to-end tests.

A Llama-architecture model is built from a transformers config with random init (nothing
is downloaded) and trained with AdamW on a synthetic next-token task: every sequence
follows a fixed random affine rule over the vocabulary with some noise, so the loss really
falls and gradients are structured, as in post-training. Everything is deterministic by
seed (CPU, fixed thread count).

Regimes, as in RL post-training:
* `fp32-master`: fp32 parameters and optimizer, the served view is their bf16 cast;
* `bf16`: parameters and optimizer state in bf16, the view is the parameters themselves.

`train` yields after every optimizer step so that callers take the view when they want.
`load_trajectory` keeps the bf16 views of a run on disk (step 0 in full, then the changed
positions and bits of each step, a few MB per step), so repeated benchmarks don't retrain.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

Regime = Literal["fp32-master", "bf16"]
REGIMES: tuple[Regime, ...] = ("fp32-master", "bf16")


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    intermediate: int
    layers: int
    vocab: int


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(hidden=192, intermediate=512, layers=2, vocab=2048),  # ~1.7M parameters: tests, demo
    # ~27M parameters in tensors of 0.6-6.3M elements: closer to real layers, whose size
    # (not their count) is what weight sync moves
    "bench": ModelSize(hidden=768, intermediate=2048, layers=2, vocab=8192),
}
DEFAULT_CACHE = Path(".bench/trajectories")
WARMUP_LR = 1e-3
_BATCH, _SEQ = 4, 64
_FORMAT = 1

if TYPE_CHECKING:  # torch stays a lazy import for the CLI
    import torch


def build_model(size: str = "tiny", seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Llama-style causal LM of a named size (fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = SIZES[size]
    config = LlamaConfig(
        hidden_size=dims.hidden,
        intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers,
        vocab_size=dims.vocab,
        num_attention_heads=max(1, dims.hidden // 64),
        num_key_value_heads=max(1, dims.hidden // 64),
        max_position_embeddings=_SEQ,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.train(False)
    return model


def _batch(vocab: int, seed: int, step: int) -> torch.Tensor:
    """Token sequences following t' = (a t + c) mod V, with 10% uniform noise."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rule = torch.Generator().manual_seed(seed)
    a = int(torch.randint(1, vocab, (1,), generator=rule)) | 1
    c = int(torch.randint(0, vocab, (1,), generator=rule))
    tokens = torch.empty(_BATCH, _SEQ, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (_BATCH,), generator=g)
    for i in range(1, _SEQ):
        tokens[:, i] = (tokens[:, i - 1] * a + c) % vocab
    noise = torch.rand(_BATCH, _SEQ, generator=g) < 0.1
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return tokens


def train(
    model: torch.nn.Module,
    *,
    steps: int,
    lr: float,
    regime: Regime,
    seed: int = 0,
    warmup_steps: int = 0,
    warmup_lr: float = WARMUP_LR,
) -> Iterator[int]:
    """Train `model` in place for `steps` AdamW steps, yielding the step number after each,
    and 0 once before the first (after any warm-up): take the view at every yield.

    The `bf16` regime casts the model to bf16 first (parameters and optimizer state).
    `warmup_steps` steps at `warmup_lr` run first, unyielded, with the same optimizer: RL
    post-training starts from a trained policy whose Adam moments are warm, and a fresh
    Adam's first steps (every update exactly +-lr) would overstate how much of the view
    changes.
    """
    import torch

    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    if regime == "bf16":
        model.to(torch.bfloat16)
    vocab = int(cast(Any, model).config.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=warmup_lr if warmup_steps else lr, weight_decay=0.0)
    model.train(True)
    for step in range(1 - warmup_steps, steps + 1):
        if step == 1:
            for group in opt.param_groups:
                group["lr"] = lr
            yield 0
        tokens = _batch(vocab, seed, step + warmup_steps)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= 1:
            yield step
    if steps == 0:
        yield 0
    model.train(False)


@dataclass(frozen=True)
class ViewTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Trajectory:
    """The rollout views of one training run, held on disk, rebuilt step by step on demand."""

    def __init__(self, directory: Path) -> None:
        meta = json.loads((directory / "meta.json").read_text())
        self.directory = directory
        self.steps: int = meta["steps"]
        self.tensors = [
            ViewTensor(t["name"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"])
            for t in meta["tensors"]
        ]
        self._flat = np.load(directory / "step-0.npy")
        self._at = 0

    @property
    def view_bytes(self) -> int:
        return int(self._flat.size)

    def _advance(self, step: int) -> None:
        if step < self._at:
            self._flat = np.load(self.directory / "step-0.npy")
            self._at = 0
        flat16 = self._flat.view(np.uint16)
        while self._at < step:
            self._at += 1
            with np.load(self.directory / f"step-{self._at}.npz") as d:
                flat16[d["positions"]] = d["bits"]

    def view(self, step: int) -> dict[str, np.ndarray]:
        """Raw bytes of every view tensor (BF16) at `step` (0: before training). Copies."""
        if not 0 <= step <= self.steps:
            raise IndexError(f"step {step} outside 0..{self.steps}")
        self._advance(step)
        return {t.name: self._flat[t.offset : t.offset + t.nbytes].copy() for t in self.tensors}


def _key(size: str, regime: Regime, lr: float, steps: int, seed: int, warmup: int) -> str:
    # the model's dimensions are part of the key: changing a size must not reuse old views
    text = f"v{_FORMAT}-{SIZES[size]}-{regime}-{lr:g}-{steps}-{seed}-{warmup}-{WARMUP_LR:g}"
    return f"{size}-{regime}-{lr:g}-{steps}-s{seed}-w{warmup}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def load_trajectory(
    *,
    size: str,
    regime: Regime,
    lr: float,
    steps: int,
    seed: int = 0,
    warmup_steps: int = 0,
    cache: Path = DEFAULT_CACHE,
    progress: Callable[[int], Any] | None = None,
) -> Trajectory:
    """The trajectory for these settings, trained and stored on first use.

    Step 0 is the view after `warmup_steps` steps at `WARMUP_LR` (see `train`).
    """
    directory = cache / _key(size, regime, lr, steps, seed, warmup_steps)
    if not (directory / "meta.json").exists():
        _record(directory, size, regime, lr, steps, seed, warmup_steps, progress)
    return Trajectory(directory)


def _flat_view(model: torch.nn.Module) -> tuple[np.ndarray, list[dict[str, Any]]]:
    from deltaboard.board.contract.schemas import ViewSpec
    from deltaboard.publisher.view import rollout_view, safetensors_dtype, tensor_bytes

    view = rollout_view(model.state_dict(), ViewSpec())
    parts, tensors, offset = [], [], 0
    for name, t in view.items():
        raw = tensor_bytes(t)
        tensors.append(
            {
                "name": name,
                "dtype": safetensors_dtype(t),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": raw.size,
            }
        )
        parts.append(raw)
        offset += raw.size
    return np.concatenate(parts), tensors


def _record(
    directory: Path,
    size: str,
    regime: Regime,
    lr: float,
    steps: int,
    seed: int,
    warmup_steps: int,
    progress: Callable[[int], Any] | None,
) -> None:
    import torch

    torch.set_num_threads(2)
    tmp = directory.with_name(directory.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model = build_model(size, seed)
    prev = np.empty(0, dtype=np.uint8)
    tensors: list[dict[str, Any]] = []
    for step in train(model, steps=steps, lr=lr, regime=regime, seed=seed, warmup_steps=warmup_steps):
        flat, tensors = _flat_view(model)
        if step == 0:
            np.save(tmp / "step-0.npy", flat)
            prev = flat
            continue
        a, b = prev.view(np.uint16), flat.view(np.uint16)
        positions = np.flatnonzero(a != b)
        np.savez(tmp / f"step-{step}.npz", positions=positions, bits=b[positions])
        prev = flat
        if progress is not None:
            progress(step)
    meta = {
        "format": _FORMAT,
        "size": size,
        "regime": regime,
        "lr": lr,
        "steps": steps,
        "seed": seed,
        "warmup_steps": warmup_steps,
        "tensors": tensors,
    }
    (tmp / "meta.json").write_text(json.dumps(meta))
    tmp.replace(directory)
