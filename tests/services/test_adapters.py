"""Engine adapters against fake SGLang/vLLM servers (their documented routes only) and the
real reference engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaboard.clients.engines import (
    CommitMode,
    EngineAdapter,
    EngineAdapterError,
    EngineStamp,
    make_adapter,
)
from deltaboard.services.engine.app import EngineState, create_app
from deltaboard.services.sidecar.background import BackgroundServer
from tests.services.fakes.engines import fake_sglang, fake_vllm
from tests.services.fakes.tiny_model import save_tiny_model


def swap(adapter: EngineAdapter, mode: CommitMode, directory: Path, version: int) -> EngineStamp:
    adapter.pause(mode)
    stamp = adapter.reload(directory, version, mode)
    adapter.resume(mode)
    return stamp


@pytest.fixture
def sglang():
    calls: list[tuple[str, Any]] = []
    with BackgroundServer(fake_sglang(calls)) as server:
        adapter = make_adapter("sglang", server.url)
        yield adapter, calls
        adapter.close()


@pytest.fixture
def vllm():
    calls: list[tuple[str, Any]] = []
    with BackgroundServer(fake_vllm(calls)) as server:
        adapter = make_adapter("vllm", server.url)
        yield adapter, calls
        adapter.close()


def test_sglang_in_place_pauses_updates_without_flushing_and_continues(sglang, tmp_path):
    adapter, calls = sglang
    swap(adapter, "in_place", tmp_path, 4)
    assert [name for name, _ in calls] == [
        "pause_generation",
        "update_weights_from_disk",
        "continue_generation",
    ]
    assert calls[0][1] == {"mode": "in_place"}
    update = calls[1][1]
    assert update["model_path"] == str(tmp_path) and update["weight_version"] == "4"
    assert update["flush_cache"] is False and update["abort_all_requests"] is False


def test_sglang_quiesce_updates_then_flushes_the_cache(sglang, tmp_path):
    adapter, calls = sglang
    swap(adapter, "quiesce", tmp_path, 5)
    assert [name for name, _ in calls] == ["update_weights_from_disk", "flush_cache"]
    assert adapter.healthy()


def test_sglang_stamp_is_the_version_label_and_the_path_it_loaded(sglang, tmp_path):
    adapter, _ = sglang
    stamp = swap(adapter, "quiesce", tmp_path, 5)
    assert stamp == EngineStamp("5", source=str(tmp_path)) == adapter.loaded()
    other = tmp_path / "other"
    other.mkdir()
    httpx.post(f"{adapter.url}/update_weights_from_disk", json={"model_path": str(other)})
    assert adapter.loaded() != stamp  # same label, other weights: the path tells them apart
    assert ("POST", "/generate") in adapter.inference_routes
    assert ("POST", "/update_weights_from_disk") not in adapter.inference_routes


def test_sglang_refusal_is_an_adapter_error(sglang, tmp_path):
    adapter, _ = sglang
    with pytest.raises(EngineAdapterError, match="no such checkpoint"):
        adapter.reload(tmp_path / "missing", 1, "in_place")


def test_vllm_in_place_keeps_requests_reloads_and_resumes(vllm, tmp_path):
    adapter, calls = vllm
    swap(adapter, "in_place", tmp_path, 7)
    assert calls == [
        ("pause", "keep"),
        ("collective_rpc", "reload_weights"),
        ("update_weight_version", "7"),
        ("resume", None),
    ]


def test_vllm_quiesce_reloads_and_resets_the_prefix_cache(vllm, tmp_path):
    adapter, calls = vllm
    assert swap(adapter, "quiesce", tmp_path, 8) == EngineStamp("8") == adapter.loaded()
    assert calls == [
        ("collective_rpc", "reload_weights"),
        ("update_weight_version", "8"),
        ("reset_prefix_cache", None),
    ]
    assert ("POST", "/v1/embeddings") in adapter.inference_routes
    assert ("POST", "/collective_rpc") not in adapter.inference_routes


@pytest.mark.parametrize("kind", ["sglang", "vllm", "reference"])
def test_unreachable_engine_is_an_adapter_error(kind, tmp_path):
    with BackgroundServer(fake_vllm([])) as server:
        url = server.url  # a port that was just released: nothing listens there any more
    adapter = make_adapter(kind, url)
    assert not adapter.healthy()
    with pytest.raises(EngineAdapterError):
        swap(adapter, "in_place", tmp_path, 1)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown engine kind"):
        make_adapter("tgi", "http://127.0.0.1:1")


def test_reference_adapter_drives_the_real_engine(tmp_path):
    directory = save_tiny_model(tmp_path / "m")
    with BackgroundServer(create_app(EngineState("tiny"))) as server:
        adapter = make_adapter("reference", server.url)
        assert swap(adapter, "in_place", directory, 2) == EngineStamp("2", loads=1) == adapter.loaded()
        health = httpx.get(f"{server.url}/health").json()
        assert health["weight_version"] == 2 and health["paused"] is False and adapter.healthy()
        assert swap(adapter, "quiesce", directory, 2) == EngineStamp("2", loads=2)  # same label, new load
        models = httpx.get(f"{server.url}/v1/models")
        assert adapter.stamp_of(models.headers) == EngineStamp("2", loads=2)
        swap(adapter, "quiesce", directory, 3)
        assert httpx.get(f"{server.url}/health").json()["weight_version"] == 3
        with pytest.raises(EngineAdapterError, match="400"):
            adapter.reload(tmp_path / "missing", 4, "quiesce")
        adapter.close()


def test_each_call_is_told_its_mode_none_is_remembered(sglang, tmp_path):
    adapter, calls = sglang
    swap(adapter, "in_place", tmp_path, 4)
    del calls[:]
    adapter.reload(tmp_path, 5, "quiesce")  # a reload after an in-place swap, as on restart
    assert [name for name, _ in calls] == ["update_weights_from_disk", "flush_cache"]
    assert calls[0][1]["flush_cache"] is True
