"""`deltaboard bench publish --ranks 2` on a tiny view: two gloo ranks on CPU publish their
row slices (uneven: an odd row count) and one rank the whole view, to one board."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from deltaboard.services.cli import build_app

RANK_FIELDS = {
    "rank",
    "shard_view_bytes",
    "blocked_ms",
    "e2e_s",
    "sent_bytes",
    "changed_fraction",
    "peak_extra_bytes",
    "memory_bound_bytes",
}


def test_bench_publish_with_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    args = ["bench", "publish", "--ranks", "2", "--quick", "--view-gb", "0.002", "--json", str(out)]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    assert "board bytes per delta" in result.output
    report = json.loads(out.read_text())
    one, ranks = report["one_rank"], report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in [one, *ranks]:
        assert set(r) == RANK_FIELDS
        assert r["blocked_ms"] > 0 and r["e2e_s"] > 0 and r["sent_bytes"] > 0
        assert 0 < r["changed_fraction"] < 0.1
        assert r["memory_bound_bytes"] > 0
    # The slices cover the view once, unevenly; together they change what the one rank changes.
    assert sum(r["shard_view_bytes"] for r in ranks) == one["shard_view_bytes"]
    assert ranks[0]["shard_view_bytes"] != ranks[1]["shard_view_bytes"]
    assert abs(report["sent_ratio"] - 1) < 0.1
    # On the board, parts add manifest entries, which weigh at this size (2 MB of view)
    assert 1 <= report["board_bytes_ratio"] < 1.5
    assert report["memory_within_bound"] is True
