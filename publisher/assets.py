"""The run's assets: the files besides the weights that make a directory loadable.

A follower materializes safetensors shards from the versions; `config.json`, the
tokenizer files and `generation_config.json` travel once, as run assets, so that the
directory it keeps is a Hugging Face checkpoint an engine can load as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from deltaboard.board.contract.schemas import ASSET_NAME_RE

# Weight files are versions, not assets; optimizer and trainer state never reach an engine.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".h5")
SKIPPED = {"optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin", "rng_state.pth"}
MAX_ASSET_BYTES = 64 << 20


def asset_files(directory: Path) -> dict[str, Path]:
    """Top-level files of a checkpoint directory that are assets, by asset name."""
    found: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        name = path.name
        if not path.is_file() or name in SKIPPED or name.endswith(WEIGHT_SUFFIXES):
            continue
        if ASSET_NAME_RE.match(name) and path.stat().st_size <= MAX_ASSET_BYTES:
            found[name] = path
    return found


def read_assets(source: str | Path | Mapping[str, bytes]) -> dict[str, bytes]:
    """Assets from a checkpoint directory, or given as a mapping of name to bytes."""
    if isinstance(source, Mapping):
        bad = [n for n in source if not ASSET_NAME_RE.match(n)]
        if bad:
            raise ValueError(f"invalid asset names: {bad}")
        return dict(source)
    directory = Path(source)
    if not directory.is_dir():
        raise ValueError(f"assets directory {directory} does not exist")
    return {name: path.read_bytes() for name, path in asset_files(directory).items()}
