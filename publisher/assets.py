"""The run's assets: the files besides the weights that make a directory loadable.

A follower materializes safetensors shards from the versions; `config.json`, the
tokenizer files and `generation_config.json` travel once, as run assets, so that the
directory it keeps is a Hugging Face checkpoint an engine can load as is. They come from
a checkpoint directory (its files and those of its sub-folders, such as a
sentence-transformers `1_Pooling/config.json`), a mapping of name to bytes, or the model
itself (`model_assets`: its config and generation config).

The config must describe what is served, not what the trainer holds: `describe_view`
sets its dtype to the view's, so that `from_pretrained(DIR)` without `dtype=` (and an
engine with `dtype=auto`) loads a bf16 view of an fp32 trainer as bf16.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from deltaboard.board.contract.schemas import ASSET_NAME_RE, ViewSpec
from deltaboard.board.contract.view_spec import FP8_BLOCK

log = logging.getLogger(__name__)

# Weight files are versions, not assets; optimizer and trainer state never reach an engine.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
    ".h5",
    ".msgpack",
    ".ckpt",
    ".onnx",
    ".onnx_data",
    ".gguf",
)
SKIPPED = {"optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin", "rng_state.pth"}
MAX_ASSET_BYTES = 64 << 20
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# The config's name for each served dtype (`torch_dtype` before transformers 4.56, `dtype` since).
CONFIG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# What transformers' `FineGrainedFP8Config` (and vLLM/SGLang's `fp8` method) read from an
# FP8 checkpoint with 128x128 block scales, as DeepSeek-V3 and Qwen3-FP8 ship it.
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def _is_asset(path: Path, name: str) -> bool:
    return (
        path.is_file()
        and path.name not in SKIPPED
        and not name.endswith(WEIGHT_SUFFIXES)
        and ASSET_NAME_RE.fullmatch(name) is not None
        and path.stat().st_size <= MAX_ASSET_BYTES
    )


def asset_files(directory: Path) -> dict[str, Path]:
    """The files of a checkpoint directory that are assets, by asset name: its own and
    those of its sub-folders (asset names are at most one folder deep; a trainer's
    `checkpoint-*` folders are other checkpoints, not assets)."""
    found: dict[str, Path] = {}
    deeper: list[str] = []
    for path in sorted(directory.iterdir()):
        if not path.is_dir():
            if _is_asset(path, path.name):
                found[path.name] = path
            continue
        if path.name.startswith("checkpoint-") or not ASSET_NAME_RE.fullmatch(path.name):
            continue
        for inner in sorted(path.iterdir()):
            name = f"{path.name}/{inner.name}"
            if inner.is_dir():
                deeper.append(name)
            elif _is_asset(inner, name):
                found[name] = inner
    if deeper:
        log.warning("not published as assets (more than one folder deep): %s", ", ".join(deeper))
    return found


def read_assets(source: str | Path | Mapping[str, bytes]) -> dict[str, bytes]:
    """Assets from a checkpoint directory, or given as a mapping of name to bytes."""
    if isinstance(source, Mapping):
        bad = [n for n in source if not ASSET_NAME_RE.fullmatch(n)]
        if bad:
            raise ValueError(f"invalid asset names: {bad}")
        return dict(source)
    directory = Path(source)
    if not directory.is_dir():
        raise ValueError(f"assets directory {directory} does not exist")
    return {name: path.read_bytes() for name, path in asset_files(directory).items()}


def model_assets(model: object) -> dict[str, bytes] | None:
    """A Hugging Face model's `config.json` and `generation_config.json`, as
    `save_pretrained` writes them; None for anything without a config."""
    config_json = getattr(getattr(model, "config", None), "to_json_string", None)
    if not isinstance(model, torch.nn.Module) or config_json is None:
        return None
    assets = {CONFIG: config_json().encode()}
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        assets[GENERATION_CONFIG] = generation.to_json_string().encode()
    return assets


def describe_view(assets: Mapping[str, bytes], spec: ViewSpec) -> dict[str, bytes]:
    """The assets with `config.json`'s dtype set to the view's default dtype (`dtype`, and
    `torch_dtype` where the config has that older key) and, for a view with FP8 block
    rules, Hugging Face's fine-grained FP8 `quantization_config`; a config that is not a
    JSON object is left as it is."""
    out = dict(assets)
    try:
        config = json.loads(out[CONFIG])
    except (KeyError, ValueError):
        return out
    if not isinstance(config, dict):
        return out
    served = CONFIG_DTYPES[spec.default_dtype]
    config["dtype"] = served
    if "torch_dtype" in config:
        config["torch_dtype"] = served
    if any(rule.dtype == FP8_BLOCK for rule in spec.rules):
        config["quantization_config"] = FP8_QUANTIZATION_CONFIG
    out[CONFIG] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return out
