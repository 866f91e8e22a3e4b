"""`bench update` end to end on a small view: every figure present, the hot path exact."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from deltaboard.services.bench import follow_bench, update_bench
from deltaboard.services.cli import build_app

KEYS = (
    "view_gb",
    "device",
    "changed_fraction",
    "hot_pause_ms",
    "hot_ready_s",
    "disk_ready_s",
    "reload_ready_s",
    "reload_pause_ms",
)


def test_bench_update_small_view(tmp_path) -> None:
    config = update_bench.BenchConfig(view_gb=0.004, versions=2, tensors=6)
    report = update_bench.run_shapes(config, 40, lambda _: None)
    assert report["hot_bit_exact"] is True  # the engine's weights are the trainer's view
    assert 0.005 < report["changed_fraction"] < 0.02
    for key in KEYS:
        assert key in report, key
    assert report["hot_pause_ms"] > 0 and report["reload_pause_ms"] > 0
    assert report["hot_ready_s"] >= report["hot_fetch_s"] + report["hot_decode_s"] + report["hot_stage_s"]
    assert report["many_tensors"]["tensors"] >= 40
    assert len(report["versions"]) == 2
    assert report["hot_pause_cpu_ms"] >= 0
    assert report["phases_s"]["generating the view"] > 0  # the setup's phases are timed


def test_bench_update_command_writes_json(tmp_path, monkeypatch) -> None:
    small = update_bench.BenchConfig(view_gb=0.002, versions=1, tensors=4)
    monkeypatch.setattr(update_bench, "quick", lambda device: small)
    out = tmp_path / "update.json"
    result = CliRunner().invoke(build_app(), ["bench", "update", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert set(KEYS) <= set(json.loads(out.read_text()))


def test_the_synthetic_view_and_its_steps_do_not_depend_on_the_threads() -> None:
    """The view is drawn and stepped one tensor per thread: each tensor's generator is its
    own, so one thread or several give the same bits."""
    config = follow_bench.BenchConfig(view_gb=0.004, tensor_elements=1 << 17)
    stats = follow_bench.trajectory_stats()
    runs = []
    for threads in (1, 4):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "cpu_count", lambda threads=threads: threads)
            trainer = follow_bench.SyntheticTrainer(config, stats)
            first = {name: bits.copy() for name, bits in trainer.bits.items()}
            trainer.step()
            trainer.step()
            runs.append((first, trainer.bits, trainer.pages_touched))
    (first_a, bits_a, pages_a), (first_b, bits_b, pages_b) = runs
    assert len(bits_a) > 4 and pages_a == pages_b > 0
    for name in bits_a:
        assert np.array_equal(first_a[name], first_b[name])
        assert np.array_equal(bits_a[name], bits_b[name])
        assert not np.array_equal(first_a[name], bits_a[name])  # the steps changed something
