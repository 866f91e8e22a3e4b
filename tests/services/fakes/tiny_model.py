"""A tiny causal LM saved as a bf16 Hugging Face directory, built from a config (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_config(**overrides: Any) -> Any:
    """A two-layer Llama config; `overrides` set any of its fields."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    }
    return LlamaConfig(**(fields | overrides))


def save_tiny_model(directory: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory)
    return directory
