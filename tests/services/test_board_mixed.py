"""`bench board --mixed` end to end on a small load: every figure it reports is there and
sane, so a change to the bench (or the board's routes it uses) cannot break it unseen."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console

from deltaboard.services.bench.board_bench import board_process
from deltaboard.services.bench.board_mixed import MixedConfig, measure_mixed, run_on_uvloop


def test_a_small_mixed_run_reports_every_figure(tmp_path: Path) -> None:
    config = MixedConfig(pollers=20, downloaders=2, seconds=3.0, blob_mb=1)
    with board_process(tmp_path / "board") as url:
        results = run_on_uvloop(measure_mixed(url, config, tmp_path, Console(quiet=True)))
    assert results["mixed_errors"] == 0
    assert results["mixed_commits"] == 3 and results["mixed_downloads"] > 0
    # Every poller is woken, by the last commit at least (its wakes are waited for).
    assert config.pollers <= results["mixed_wakes"] <= 3 * config.pollers
    for key in ("mixed_commit_p99_ms", "mixed_commit_in_board_p99_ms", "mixed_disk_sync_p99_ms"):
        assert math.isfinite(results[key]) and results[key] > 0, key
    # The pollers' own lag is measured through the run (NaN, failing this, had it never ticked).
    assert 0 <= results["mixed_poller_lag_p50_ms"] <= results["mixed_poller_lag_p99_ms"]
    # The board's own time is part of each commit's latency.
    assert all(own <= latency for _, latency, own in results["mixed_commit_slowest_ms"])
    assert len(results["mixed_commit_slowest_ms"]) == 3
    # The downloaders stand for other hosts: below the board's CPU priority, and said so.
    assert results["mixed_downloaders_nice"] > 0
