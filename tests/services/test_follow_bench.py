"""`bench follow` end to end on a small view: every figure present and consistent."""

from __future__ import annotations

from deltaboard.services.bench import follow_bench


def test_bench_follow_small_view() -> None:
    config = follow_bench.BenchConfig(view_gb=0.008, catchup_k=3, steady=1, tensor_elements=1 << 18)
    report = follow_bench.run(config, lambda _: None)
    assert 0.005 < report["changed_fraction"] < 0.02
    for key in (
        "apply_verify_s",
        "full_write_s",
        "page_touch_s",
        "codec_decode_s",
        "bootstrap_s",
        "bootstrap_deltas_s",
    ):
        assert report[key] > 0, key
    assert report["page_touch_ratio"] == report["page_touch_s"] / report["full_write_s"]
    # without spans the plan fetches the cheaper of a keyframe and the chain of deltas;
    # with the span 1 -> 3, less: the delta to 1, then the span
    assert report["catchup_deltas_bytes"] == min(report["keyframe_bytes"], report["replay_bytes"])
    assert 0 < report["span_bytes"] < report["catchup_bytes"] < report["catchup_deltas_bytes"]
    assert report["catchup_strategy"] == "spans" and report["compact_s"] > 0
    assert report["compact_incremental_s"] > 0
    assert report["catchup_cpu_s"] > 0 and report["ranged_threads"] >= 4
    # a new node starts at the worker's keyframe of head, not at the trainer's first one
    assert report["bootstrap_strategy"] == "keyframe+deltas" and report["keyframe_build_s"] > 0
    assert 0 < report["bootstrap_bytes"] < report["keyframe_bytes"] + report["replay_bytes"]
    # the bootstrap's CPU per GB beside the floors of the same run, all measured
    assert report["bootstrap_cpu_per_gb"]["follower"] > 0 and report["bootstrap_cpu_per_gb"]["board"] >= 0
    assert set(report["floor_cpu_per_gb"]) == {"memcpy_fresh", "loopback_read"}
    assert all(v >= 0 for v in report["floor_cpu_per_gb"].values())
    assert set(report["targets"]) == {
        "apply_verify_le_0.1x_full_write",
        "catchup_le_one_keyframe",
        "catchup_le_0.4x_replay",
        "bootstrap_le_2s_per_gb",
    }
