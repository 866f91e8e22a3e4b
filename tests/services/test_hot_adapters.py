"""The SGLang and vLLM adapters' in-place path, over real HTTP, against the imitations.

The sidecar drives `stage_patch` / `commit_patch`; the imitations (fakes/fused_engines.py)
serve the engines' own routes and call deltaboard's hooks the way each engine does, over
ranks holding a tiny transformers model in the engine's fused, tensor-parallel layout.
These check what the adapters add on top of the hooks: the control routes around the
swap in each mode (hold and release running requests in place; flush or reset the prefix
cache after a drained swap), the version the engine then reports, and that a refused
patch surfaces as `HotRefused` with every rank unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deltaboard.clients.engines import CommitMode, HotRefused
from deltaboard.clients.engines.fused import Layout
from deltaboard.clients.engines.sglang import SGLangAdapter
from deltaboard.clients.engines.vllm import VLLMAdapter
from deltaboard.clients.resident import write_patch
from deltaboard.services.sidecar.background import BackgroundServer
from tests.services.fakes.fused_engines import SGLangState, VLLMState, sglang_app, vllm_app
from tests.services.fakes.fused_models import (
    dims_of,
    install_parallel_state,
    rank_models,
    tiny_llama,
    view_bits,
)
from tests.services.test_fused_hot import encode_patch, next_view

TP = 2


@pytest.fixture
def llama(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    install_parallel_state(monkeypatch)
    yield tiny_llama(seed=3)


def held(ranks: list[Any], model: Any, view: dict[str, np.ndarray]) -> bool:
    expected = [Layout(dims_of(model), TP, r).build(view) for r in range(TP)]
    return all(
        all(np.array_equal(rank.bits()[name], want[name]) for name in want)
        for rank, want in zip(ranks, expected, strict=True)
    )


@pytest.mark.parametrize("mode", ["in_place", "quiesce"])
def test_sglang_adapter_swaps_in_place(llama, tmp_path: Path, mode: CommitMode) -> None:
    view = view_bits(llama)
    ranks = rank_models(llama, view, TP)
    state = SGLangState()
    new = next_view(view, np.random.default_rng(0))
    write_patch(encode_patch(view, new, 0, 1), tmp_path / "1.patch")
    from deltaboard.clients.engines import sglang_hot

    with BackgroundServer(sglang_app(ranks, [sglang_hot.LOAD_FORMAT], state)) as engine:
        adapter = SGLangAdapter(engine.url, hot=True)
        adapter.stage_patch(tmp_path / "1.patch", 1)
        assert held(ranks, llama, view)  # staged, not yet written
        committed = adapter.commit_patch(1, mode)
        adapter.close()
    assert held(ranks, llama, new)
    assert committed.stamp.version == "1" and committed.pause_ms is not None
    commit = state.calls.index("update_weights_from_tensor", 1)  # the second update is the commit
    if mode == "in_place":
        assert (
            state.calls[commit - 1] == "pause_generation" and state.calls[commit + 1] == "continue_generation"
        )
        assert state.flushes == 0  # running requests keep their cache
    else:
        assert "pause_generation" not in state.calls and state.flushes == 1


@pytest.mark.parametrize("mode", ["in_place", "quiesce"])
def test_vllm_adapter_swaps_in_place(llama, tmp_path: Path, mode: CommitMode) -> None:
    from deltaboard.clients.engines import vllm_hot

    view = view_bits(llama)
    ranks = rank_models(llama, view, TP)
    state = VLLMState()
    new = next_view(view, np.random.default_rng(1))
    write_patch(encode_patch(view, new, 0, 1), tmp_path / "1.patch")
    with BackgroundServer(vllm_app(ranks, vllm_hot.EXTENSION, state)) as engine:
        adapter = VLLMAdapter(engine.url, hot=True)
        adapter.stage_patch(tmp_path / "1.patch", 1)
        committed = adapter.commit_patch(1, mode)
        adapter.close()
    assert held(ranks, llama, new)
    assert committed.stamp.version == "1"
    commit = state.calls.index("collective_rpc deltaboard_commit")
    if mode == "in_place":
        assert state.calls[commit - 1] == "pause" and state.calls[commit + 1] == "resume"
        assert "reset_prefix_cache" not in state.calls
    else:
        assert "pause" not in state.calls and state.calls[-1] == "reset_prefix_cache"


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_patch_for_another_base_is_refused_and_nothing_changes(llama, tmp_path: Path, kind: str) -> None:
    from deltaboard.clients.engines import sglang_hot, vllm_hot

    view = view_bits(llama)
    ranks = rank_models(llama, view, TP)
    other = next_view(view, np.random.default_rng(2))
    newer = next_view(other, np.random.default_rng(3))
    write_patch(encode_patch(other, newer, 0, 1), tmp_path / "1.patch")  # its base is not what ranks hold
    app = (
        sglang_app(ranks, [sglang_hot.LOAD_FORMAT], SGLangState())
        if kind == "sglang"
        else vllm_app(ranks, vllm_hot.EXTENSION)
    )
    with BackgroundServer(app) as engine:
        adapter = (SGLangAdapter if kind == "sglang" else VLLMAdapter)(engine.url, hot=True)
        with pytest.raises(HotRefused):
            adapter.stage_patch(tmp_path / "1.patch", 1)
        adapter.close()
    assert held(ranks, llama, view)
