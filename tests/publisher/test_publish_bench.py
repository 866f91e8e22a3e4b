"""`bench publish --tensors N` and `--throughput` on tiny views: the figures they report."""

from __future__ import annotations

from deltaboard.services.bench import publish_bench


def test_shapes_publish_the_same_bits_as_many_small_and_few_large_tensors():
    config = publish_bench.BenchConfig(
        view_gb=0.004, size="tiny", deltas=1, links_gbit=(10.0,), tensors=1000, warmup_steps=16
    )
    report = publish_bench.run_shapes(config, lambda _: None)
    many, few = report["shapes"]
    assert (many["tensors"], few["tensors"]) == (1000, publish_bench.FEW_TENSORS)
    assert many["changed_fraction"] == few["changed_fraction"] > 0  # the same bits, cut otherwise
    assert many["manifest_bytes"] > few["manifest_bytes"]
    assert report["many_over_few"] == many["e2e_s"] / few["e2e_s"]


def test_throughput_reports_both_hint_modes_and_the_copy_limit_on_cpu():
    report = publish_bench.throughput((0.01,), 0.01, "cpu", repeats=1)
    rows = report["rows"]
    assert [(r["pass"], r["hints"], r["shape"].startswith("model")) for r in rows] == [
        ("torch", False, False),
        ("torch", True, False),
        ("torch", False, True),
        ("torch", True, True),
    ]
    assert all(0.005 < r["changed_fraction"] < 0.02 for r in rows)
    assert rows[1]["hint_bytes"] > 0 and rows[0]["hint_bytes"] == 0
    assert report["copy_gbps"] > 0 and report["view_limit_gbps"] == report["copy_gbps"] / 3
