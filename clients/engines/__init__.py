"""Engine adapters: how a rollout sidecar makes an inference engine load a new version.

`EngineAdapter` (in `base`) is the port; `sglang`, `vllm` and `reference` drive each
engine's own weight-reload routes, name its inference routes and read what it holds
(`EngineStamp`). `make_adapter(kind, url)` picks one by name.
"""

from __future__ import annotations

from deltaboard.clients.engines.base import (
    CommitMode,
    EngineAdapter,
    EngineAdapterError,
    EngineStamp,
    HotCommitted,
    HotRefused,
)
from deltaboard.clients.engines.reference import ReferenceAdapter
from deltaboard.clients.engines.sglang import SGLangAdapter
from deltaboard.clients.engines.vllm import VLLMAdapter

ADAPTERS: dict[str, type[EngineAdapter]] = {
    "reference": ReferenceAdapter,
    "sglang": SGLangAdapter,
    "vllm": VLLMAdapter,
}


def make_adapter(kind: str, url: str, timeout_s: float = 600.0, *, hot: bool = False) -> EngineAdapter:
    try:
        adapter = ADAPTERS[kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {kind!r}; expected one of {sorted(ADAPTERS)}") from None
    return adapter(url, timeout_s=timeout_s, hot=hot)


__all__ = [
    "ADAPTERS",
    "CommitMode",
    "EngineAdapter",
    "EngineAdapterError",
    "EngineStamp",
    "HotCommitted",
    "HotRefused",
    "make_adapter",
]
