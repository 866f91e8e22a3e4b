"""The model the reference engine serves, the gate that pauses it, and token generation.

Every generated token comes from one full forward pass over the prompt plus the tokens
generated so far (no KV cache). That costs a little on a tiny CPU model and buys a
simple guarantee the end-to-end test relies on: the logprob reported for token t is
exactly `log_softmax(model(ids[:t]).logits[-1])[token]`, bit for bit what running the
same weights directly gives, with no cache-shape-dependent rounding in between.

Weights are swapped between forward passes (`WeightSlot.install`), so a request that
spans a reload in `in_place` mode sees the new version from its next token on; each
step records the version it ran with so the response can report its range honestly.
Every install also moves the slot's load counter (`WeightSlot.stamp`): the engine
reports it with the version, so that whoever drives the engine can tell "still the
weights I loaded" from "the same version number, other weights".
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from deltaboard.services.engine.textcodec import TextCodec, load_codec


class EngineNotLoaded(RuntimeError):
    """No model is loaded yet (the sidecar has not asked for a reload)."""


class Cancelled(RuntimeError):
    """The client went away; generation stopped between two tokens."""


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    codec: TextCodec
    version: int | None
    directory: Path
    eos_token_id: int | None
    vocab_size: int


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float
    seed: int | None
    top_logprobs: int


@dataclass(frozen=True)
class TokenStep:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    version: int | None
    finish_reason: str | None


def stored_dtype(directory: Path) -> Any:
    """The torch dtype of the checkpoint's first floating tensor: the rollout view's dtype.

    The engine computes in it, as running the served view directly would; `config.json`
    may name the trainer's dtype (fp32 master weights) instead.
    """
    import torch
    from safetensors import safe_open

    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                dtype = f.get_slice(name).get_dtype()
                if dtype in ("BF16", "F16", "F32", "F64"):
                    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(
                        dtype, torch.float64
                    )
    return "auto"


def load_model(directory: Path, version: int | None, device: str = "cpu") -> LoadedModel:
    """Load a Hugging Face checkpoint directory in the dtype of its stored tensors, on `device`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    # Eager attention: the plain reference computation, the same on every CPU and every run.
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=stored_dtype(directory), attn_implementation="eager"
    )
    model.requires_grad_(False)
    model = cast(Any, model).to(device)  # transformers types `to` for PreTrainedModel only
    vocab_size = int(model.config.vocab_size)
    eos = model.config.eos_token_id
    eos_token_id = eos if isinstance(eos, int) else None
    return LoadedModel(model, load_codec(directory, vocab_size), version, directory, eos_token_id, vocab_size)


class WeightSlot:
    """The loaded model behind a gate: forward passes are readers, pause and swap are writers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._model: LoadedModel | None = None
        self._paused = False
        self._active = 0
        self._loads = 0

    @property
    def current(self) -> LoadedModel | None:
        return self._model

    def stamp(self) -> tuple[int | None, int]:
        """(version, loads): the installed weights' version and the number of installs so
        far, read together. The counter moves with every change of the weights, so an
        unchanged counter means unchanged weights, whatever version they were labelled."""
        with self._cond:
            return (None if self._model is None else self._model.version), self._loads

    @property
    def paused(self) -> bool:
        return self._paused

    @contextmanager
    def step(self, cancel: threading.Event) -> Iterator[LoadedModel]:
        """Hold the model for one forward pass; waits while paused, gives up when cancelled."""
        with self._cond:
            while self._paused:
                if cancel.is_set():
                    raise Cancelled
                self._cond.wait(timeout=0.05)
            if self._model is None:
                raise EngineNotLoaded("no model loaded")
            self._active += 1
            model = self._model
        try:
            yield model
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def pause(self) -> None:
        """Stop admitting forward passes and wait for the running ones to finish."""
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: self._active == 0)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def install(self, model: LoadedModel) -> tuple[int | None, int]:
        """Swap the model between forward passes (never during one); returns the new stamp.

        Every change of the weights a forward pass reads goes through here (a reload, or
        weights patched in place and installed under their new version), so that the load
        counter moves with it.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._active == 0)
            self._model = model
            self._loads += 1
            return model.version, self._loads


def generate(
    slot: WeightSlot, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event
) -> Iterator[TokenStep]:
    """Yield one `TokenStep` per generated token (greedy when temperature is 0)."""
    import torch

    ids = list(prompt_ids)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    for index in range(params.max_tokens):
        if cancel.is_set():
            raise Cancelled
        with slot.step(cancel) as loaded, torch.inference_mode():
            logits = loaded.model(torch.tensor([ids], device=loaded.model.device)).logits[0, -1].float().cpu()
            version = loaded.version
            eos = loaded.eos_token_id
        logprobs = torch.log_softmax(logits, dim=-1)
        if params.temperature <= 0:
            token = int(torch.argmax(logprobs).item())
        else:
            probs = torch.softmax(logits / params.temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator).item())
        top: tuple[tuple[int, float], ...] = ()
        if params.top_logprobs > 0:
            values, indices = torch.topk(logprobs, min(params.top_logprobs, logprobs.numel()))
            top = tuple((int(i), float(v)) for i, v in zip(indices.tolist(), values.tolist(), strict=True))
        ids.append(token)
        finish = "stop" if token == eos else ("length" if index == params.max_tokens - 1 else None)
        yield TokenStep(token, float(logprobs[token].item()), top, version, finish)
        if finish == "stop":
            return
