"""`deltaboard bench codec` end to end on tiny trajectories: exact, and the JSON shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltaboard.services.cli import build_app

FIELDS = {
    "encoding",
    "regime",
    "lr",
    "k",
    "changed_fraction",
    "bits_per_changed",
    "encode_gbps",
    "apply_gbps",
    "exact",
}

SPAN_FIELDS = {
    "regime",
    "lr",
    "k",
    "changed_fraction",
    "bits_per_changed",
    "span_bytes",
    "replay_bytes",
    "x_replay",
    "exact",
}


def test_bench_codec_quick_on_tiny(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    args = [
        "bench",
        "codec",
        "--quick",
        "--size",
        "tiny",
        "--k",
        "1",
        "--k",
        "3",
        "--pairs",
        "1",
        "--warmup",
        "2",
    ]
    result = CliRunner().invoke(build_app(), [*args, "--cache", str(tmp_path / "cache"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "what limits it" in result.output
    data = json.loads(out.read_text())
    assert set(data) == {"results", "spans"}
    records = data["results"]
    keys = {(r["encoding"], r["regime"], r["lr"], r["k"]) for r in records}
    assert len(keys) == len(records) == 5 * 2 * 1 * 2
    assert {r["encoding"] for r in records} == {"full", "coo32", "pulse", "xor-zstd", "deltaboard"}
    for r in records:
        assert set(r) == FIELDS
        assert r["exact"] is True
        assert 0 < r["changed_fraction"] < 1
        assert r["bits_per_changed"] > 0 and r["encode_gbps"] > 0 and r["apply_gbps"] > 0
    ours = {(r["regime"], r["k"]): r["bits_per_changed"] for r in records if r["encoding"] == "deltaboard"}
    coo = {(r["regime"], r["k"]): r["bits_per_changed"] for r in records if r["encoding"] == "coo32"}
    assert all(ours[key] < coo[key] for key in ours)
    # the span from t to t + 3, composed from the three deltas: only k > 1 has one, and
    # it is the direct patch of the pair (what the worker stores, bit for bit)
    spans = data["spans"]
    assert sorted((s["regime"], s["k"]) for s in spans) == sorted({(r[1], 3) for r in keys})
    for sp in spans:
        assert set(sp) == SPAN_FIELDS
        assert sp["exact"] is True
        assert 0 < sp["changed_fraction"] < 1 and sp["bits_per_changed"] > 0
        assert 0 < sp["span_bytes"] < sp["replay_bytes"]
        assert sp["x_replay"] == pytest.approx(sp["span_bytes"] / sp["replay_bytes"])
        assert sp["bits_per_changed"] == pytest.approx(ours[(sp["regime"], 3)])
    assert "spans: k deltas composed" in result.output


FP8_FIELDS = {
    "scale",
    "lr",
    "k",
    "fp8_changed_fraction",
    "scale_changed_fraction",
    "view_changed_fraction",
    "bits_per_changed",
    "fp8_bytes",
    "bf16_bytes",
    "fp8_full_bytes",
    "bf16_full_bytes",
    "encode_gbps",
    "apply_gbps",
    "bf16_encode_gbps",
    "bf16_apply_gbps",
    "exact",
}


def test_bench_codec_fp8_view_on_tiny(tmp_path: Path) -> None:
    """The FP8 view's deltas beside the bf16 view's of the same fp32-master steps: exact,
    smaller per version than the whole FP8 view, which is smaller than the bf16 view."""
    out = tmp_path / "fp8.json"
    args = ["bench", "codec", "--view", "fp8", "--quick", "--size", "tiny", "--k", "1", "--k", "2"]
    result = CliRunner().invoke(build_app(), [*args, "--pairs", "1", "--warmup", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "target FP8 bytes per version" in result.output
    records = json.loads(out.read_text())["fp8"]
    assert [(r["lr"], r["k"]) for r in records] == [(1e-6, 1), (1e-6, 2)]
    for r in records:
        assert set(r) == FP8_FIELDS
        assert r["exact"] is True and r["scale"] == "amax"
        assert 0 < r["fp8_changed_fraction"] < 1 and 0 < r["view_changed_fraction"] < 1
        assert 0 <= r["scale_changed_fraction"] <= 1
        assert 0 < r["fp8_bytes"] < r["fp8_full_bytes"] < r["bf16_full_bytes"]
        assert r["bf16_bytes"] > 0 and r["bits_per_changed"] > 0


def test_bench_codec_refuses_an_unknown_view() -> None:
    result = CliRunner().invoke(build_app(), ["bench", "codec", "--view", "fp4"])
    assert result.exit_code != 0 and "view must be bf16 or fp8" in result.output
