"""`bench publish --tensors N` and `--throughput` on tiny views: the figures they report."""

from __future__ import annotations

from typing import Any

import pytest

from deltaboard.services.bench import publish_bench


def test_shapes_publish_the_same_bits_as_many_small_and_few_large_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = publish_bench.BenchConfig(
        view_gb=0.004, size="tiny", deltas=1, links_gbit=(10.0,), tensors=1000, warmup_steps=16
    )
    warmed: list[int | None] = []
    real_warm_up = publish_bench.warm_up

    def warm_up(*args: Any) -> None:
        warmed.append(args[3].tensors)
        real_warm_up(*args)

    monkeypatch.setattr(publish_bench, "warm_up", warm_up)
    report = publish_bench.run_shapes(config, lambda _: None)
    assert warmed == [1000, publish_bench.FEW_TENSORS]  # both shapes, before the timed versions
    many, few = report["shapes"]
    assert (many["tensors"], few["tensors"]) == (1000, publish_bench.FEW_TENSORS)
    assert many["changed_fraction"] == few["changed_fraction"] > 0  # the same bits, cut otherwise
    assert many["manifest_bytes"] > few["manifest_bytes"]
    assert report["many_over_few"] == many["e2e_s"] / few["e2e_s"]
    for shape in (many, few):  # the snapshot copy alone, timed beside the publishes
        assert shape["torch_copy_ms"] > 0 and shape["copy_floor_ms"] > 0


def test_the_snapshot_copy_reference_copies_every_tensor_into_its_own_place() -> None:
    import torch

    state = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.tensor([7.0, 8.0])}
    copy = publish_bench.SnapshotCopy(state)
    multi, floor = copy.timed()
    assert multi > 0 and floor > 0
    assert [t.shape for t in copy.targets] == [(2, 3), (2,)]
    assert copy.target.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0]
    assert torch.equal(copy.whole, copy.target)


def test_the_warm_up_view_is_cut_into_tensors_of_the_timed_views_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(publish_bench, "WARM_SHARE", 4)  # 12 copies of the tiny view, not 192
    traj = publish_bench._trajectory(publish_bench.BenchConfig(size="tiny", warmup_steps=16), lambda _: None)
    gb = (12 - 0.5) * traj.view_bytes / 1e9
    view = publish_bench.TiledView(traj, gb, 1, tensors=240)
    small = publish_bench.warm_view(traj, view, "cpu")
    assert (view.copies, small.copies, small.tensors) == (12, 3, 60)
    sizes = {t.numel() for t in view.state.values()}
    assert {t.numel() for t in small.state.values()} <= {min(sizes) - 1, *sizes, max(sizes) + 1}
    few = publish_bench.warm_view(traj, publish_bench.TiledView(traj, gb, 1, tensors=2), "cpu")
    assert few.tensors == 1  # larger than the warm-up view: one tensor of all of it
    model = publish_bench.warm_view(traj, publish_bench.TiledView(traj, gb, 1), "cpu")
    assert model.tensors is None and len(model.state) == 3 * len(traj.tensors)


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
