"""`deltaboard bench update`: from a commit on the board to the engine serving it.

Three rollout nodes follow the same run from a real board process on loopback, each
with an engine's weights in memory (torch tensors on `--device`, loaded from the node's
checkpoint directory as an engine loads them):

* **hot** (`hot_*`): the resident view. Per version: fetch the delta and check sha256
  (`hot_fetch_s`), decode and verify it against the served slot (`Follower.hot_patch`,
  `hot_decode_s`), stage it next to the weights (`ResidentView.stage`, `hot_stage_s`),
  then the commit, the only time the engine cannot generate (`hot_pause_ms`, the median,
  and `hot_pause_max_ms`; the process's CPU time in it, `hot_pause_cpu_ms`, which a busy
  machine does not inflate with waits for a core). Two baselines store the same changes,
  unchecked, into another engine's copy of the view: torch's indexed write
  (`torch_scatter_ms`) and, on the host, a plain compiled store loop on the commit's
  threads (`bare_scatter_ms`, `scatter.put`): the floor of any scatter of these changes.
  The disk slot follows afterwards, off the critical path (`hot_disk_s`).
* **disk slot + reload** (`disk_*`): today's path. The follower applies the version to
  its other disk slot and swaps it, then the engine reloads the whole checkpoint from
  disk (read every shard, copy into its parameters); it cannot generate during the
  reload.
* **full reload** (`reload_*`): a plain full reload of the same checkpoint from disk,
  the floor of any reload-based path.

`*_ready_s` runs from the moment the publisher's commit returned to the engine serving
the new version; medians over the measured versions, after one warm-up version reported apart
(`warmup_version`: a GPU host's first decode pays for the compiled kernels). The view is the synthetic one of
`bench follow` (bf16 N(0, 0.02) weights changed with the per-exponent rates and ULP steps
of a recorded AdamW trajectory), in `--tensors` tensors. On CUDA the publisher is handed
a copy of the view on the device, so that the versions are published as a GPU trainer
publishes them. Each phase's seconds are in `phases_s`: setting up a view of several GB
(drawing it, its keyframe, two bootstraps) is most of a run's time.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower import Follower
from deltaboard.clients.resident import HotPatch, ResidentView, scatter
from deltaboard.services.bench import follow_bench
from deltaboard.services.bench.publish_bench import board_process

RUN = follow_bench.RUN
Status = Callable[[str], None]


class Phases:
    """The benchmark's phases as it reports them, each timed: `seconds` per phase name
    (a phase ends where the next begins), for the JSON, so that a slow setup is visible."""

    def __init__(self, status: Status) -> None:
        self.status = status
        self.seconds: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def __call__(self, what: str) -> None:
        self.end()
        self._current = (what, time.perf_counter())
        self.status(what)

    def end(self) -> None:
        if self._current is not None:
            what, started = self._current
            self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - started
            self._current = None


@dataclass(frozen=True)
class BenchConfig:
    view_gb: float = 1.0
    device: str = "cpu"
    changed_fraction: float = 0.01
    versions: int = 4  # measured versions after the keyframe and one warm-up version
    tensors: int = 256
    seed: int = 0


def quick(device: str) -> BenchConfig:
    return BenchConfig(view_gb=0.25 if device == "cpu" else 2.0, device=device, versions=2, tensors=64)


def load_engine(directory: Path, device: str) -> dict[str, Any]:
    """The weights an engine holds after loading `directory` (every shard, on `device`)."""
    from safetensors.torch import load_file

    weights: dict[str, Any] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(shard, device=device))
    return weights


def reload_into(engine: dict[str, Any], directory: Path, device: str) -> None:
    """What a reload costs an engine: read every shard and copy it into the parameters."""
    import torch

    for name, tensor in load_engine(directory, device).items():
        engine[name].copy_(tensor)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def torch_scatter_s(patch: Any, engine: dict[str, Any], device: str) -> float:
    """A baseline for the commit: the same changes stored by torch's own indexed write,
    tensor by tensor, with no check and no rollback (into another engine's copy of
    the same view, which the disk path brings to the same version right after)."""
    import torch

    flats = {
        n: t.view(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        for n, t in engine.items()
    }
    changes = [
        (
            flats[t.name],
            torch.from_numpy(t.positions).to(device),
            torch.from_numpy(t.new_bits.view(f"<i{t.new_bits.itemsize}")).to(device),
        )
        for t in patch.tensors()
    ]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    for flat, positions, bits in changes:
        flat[positions] = bits
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def bare_scatter_s(patch: HotPatch, engine: dict[str, Any]) -> float:
    """The floor of the commit on the host: the same new bits stored at the same positions
    (into another engine's copy of the view) by a plain compiled store loop on the commit's
    threads, prefetched as the commit's, with no check and no rollback; the addresses
    computed untimed."""
    seconds = 0.0
    for group in patch.groups:
        ptrs = [engine[t.name].data_ptr() for t in group.tensors()]
        addrs = np.repeat(np.array(ptrs, dtype=np.int64), group.counts) + group.positions * group.width
        started = time.perf_counter()
        scatter.put(addrs, group.new_bits)
        seconds += time.perf_counter() - started
    return seconds


def trainer_view(trainer: follow_bench.SyntheticTrainer, device: str) -> Callable[[], dict[str, Any]]:
    """What the publisher is handed each version: the trainer's CPU tensors, or on CUDA a
    copy of them on the device, refreshed per version, so that the snapshot and the diff
    run on the GPU as a GPU trainer's would (the host's diff of a view of several GB is
    most of a version's setup time)."""
    if not device.startswith("cuda"):
        return lambda: trainer.state
    on_device = {name: t.to(device) for name, t in trainer.state.items()}

    def refreshed() -> dict[str, Any]:
        for name, t in on_device.items():
            t.copy_(trainer.state[name])
        return on_device

    return refreshed


def _follower(client: BoardClient, directory: Path, name: str) -> Follower:
    return Follower(client, RUN, directory, node_id=name, engine="bench")


def run(config: BenchConfig, status: Status) -> dict[str, Any]:
    elements = max(4096, round(config.view_gb * 1e9 / 2 / config.tensors) // 4096 * 4096)
    follow_config = follow_bench.BenchConfig(
        view_gb=config.view_gb,
        changed_fraction=config.changed_fraction,
        tensor_elements=elements,
        seed=config.seed,
    )
    phases = Phases(status)
    with tempfile.TemporaryDirectory(prefix="deltaboard-bench-update-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "board").mkdir()
        phases("measuring the change statistics of a recorded AdamW trajectory")
        stats = follow_bench.trajectory_stats()
        phases("generating the view")
        trainer = follow_bench.SyntheticTrainer(follow_config, stats)
        published = trainer_view(trainer, config.device)
        with board_process(tmp / "board") as (url, token), BoardClient(url, token) as client:
            from deltaboard.publisher.publisher import Publisher

            with Publisher(client, RUN, keyframe_every=10**6, lease_ttl_s=300, assets={}) as pub:
                phases("publishing the keyframe")
                pub.publish(published()).result()
                nodes = {kind: _follower(client, tmp / kind, kind) for kind in ("hot", "disk")}
                phases("bootstrapping both nodes, at once")
                with ThreadPoolExecutor(len(nodes)) as pool:  # nothing is timed here: setup only
                    list(pool.map(lambda follower: follower.sync(0), nodes.values()))
                phases("loading the engines")
                engines = {kind: load_engine(f.model_dir, config.device) for kind, f in nodes.items()}
                view = ResidentView(engines["hot"], 0)
                rows: list[dict[str, float]] = []
                # Version 1 warms up (the compiled kernels' first calls: seconds on a GPU host)
                # and is reported apart, out of the medians.
                for v in range(1, config.versions + 2):
                    phases(f"version {v}/{config.versions + 1}: publishing")
                    trainer.step()
                    result = pub.publish(published()).result()
                    committed = time.perf_counter()

                    phases(f"version {v}: hot path")
                    nodes["hot"].fetch(v)
                    fetched = time.perf_counter()
                    patch = nodes["hot"].hot_patch(v)
                    decoded = time.perf_counter()
                    staged = view.stage(patch)
                    staged_at = time.perf_counter()
                    cpu = time.process_time()
                    report = view.commit(staged)
                    pause_cpu = time.process_time() - cpu
                    hot_ready = time.perf_counter() - committed
                    phases(f"version {v}: the unchecked baselines, the hot node's disk copy")
                    bare = bare_scatter_s(patch, engines["disk"]) if config.device == "cpu" else None
                    floor = torch_scatter_s(patch, engines["disk"], config.device)
                    started = time.perf_counter()
                    nodes["hot"].sync(v)  # the background copy on disk, for restarts
                    hot_disk = time.perf_counter() - started

                    phases(f"version {v}: disk slot + reload")
                    started = time.perf_counter()
                    nodes["disk"].sync(v)
                    synced = time.perf_counter()
                    reload_into(engines["disk"], nodes["disk"].model_dir, config.device)
                    done = time.perf_counter()

                    phases(f"version {v}: full reload")
                    started_reload = time.perf_counter()
                    reload_into(engines["disk"], nodes["disk"].model_dir, config.device)
                    reload_s = time.perf_counter() - started_reload
                    rows.append(
                        {
                            "changed": result.changed_elements / max(1, result.total_elements),
                            "hot_pause_s": report.pause_s,
                            "hot_pause_cpu_s": pause_cpu,
                            "torch_scatter_s": floor,
                            **({} if bare is None else {"bare_scatter_s": bare}),
                            "hot_ready_s": hot_ready,
                            "hot_fetch_s": fetched - committed,
                            "hot_decode_s": decoded - fetched,
                            "hot_stage_s": staged_at - decoded,
                            "hot_disk_s": hot_disk,
                            "disk_ready_s": done
                            - started,  # as if it had started at the commit, like the hot path
                            "disk_pause_s": done - synced,
                            "reload_s": reload_s,
                        }
                    )
                warmup, rows = rows[0], rows[1:]
                exact = all(
                    bool((engines["hot"][name].view(-1).cpu() == trainer.state[name].view(-1)).all())
                    for name in trainer.state
                )
                for follower in nodes.values():
                    follower.close()
                phases("closing")
    phases.end()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    hot_pause_ms, reload_pause_ms = median("hot_pause_s") * 1e3, median("reload_s") * 1e3
    return {
        "view_gb": trainer.nbytes / 1e9,
        "device": config.device,
        "tensors": len(trainer.state),
        "changed_fraction": median("changed"),
        "hot_pause_ms": hot_pause_ms,
        "hot_pause_max_ms": max(r["hot_pause_s"] for r in rows) * 1e3,
        "hot_pause_cpu_ms": median("hot_pause_cpu_s") * 1e3,
        "torch_scatter_ms": median("torch_scatter_s") * 1e3,
        **({"bare_scatter_ms": median("bare_scatter_s") * 1e3} if config.device == "cpu" else {}),
        "hot_ready_s": median("hot_ready_s"),
        "hot_fetch_s": median("hot_fetch_s"),
        "hot_decode_s": median("hot_decode_s"),
        "hot_stage_s": median("hot_stage_s"),
        "hot_disk_s": median("hot_disk_s"),
        "disk_ready_s": median("disk_ready_s"),
        "disk_pause_ms": median("disk_pause_s") * 1e3,
        "reload_ready_s": median("reload_s"),
        "reload_pause_ms": reload_pause_ms,
        "pause_ratio": reload_pause_ms / hot_pause_ms if hot_pause_ms else float("inf"),
        "hot_bit_exact": exact,
        "versions": rows,
        "warmup_version": warmup,
        "phases_s": phases.seconds,
    }


def run_shapes(config: BenchConfig, many: int, status: Status) -> dict[str, Any]:
    """The same view in `config.tensors` tensors and in `many`: the commit's cost must
    follow changed elements, not tensor count."""
    few = run(config, status)
    if not many:
        return few
    status(f"the same bytes in {many} tensors")
    spread = run(replace(config, tensors=many), status)
    few["many_tensors"] = {
        k: spread[k]
        for k in (
            "tensors",
            "hot_pause_ms",
            "hot_pause_max_ms",
            "hot_pause_cpu_ms",
            "hot_ready_s",
            "hot_fetch_s",
            "hot_decode_s",
            "hot_stage_s",
            "changed_fraction",
        )
    }
    few["many_tensors_pause_ratio"] = spread["hot_pause_ms"] / few["hot_pause_ms"]
    return few


def render(report: dict[str, Any], console: Console) -> None:
    table = Table(
        title=(
            f"bench update: {report['view_gb']:.2f} GB bf16 view in {report['tensors']} tensors on "
            f"{report['device']}, {report['changed_fraction']:.2%} changed per version"
        )
    )
    table.add_column("path")
    table.add_column("commit -> serving", justify="right")
    table.add_column("engine paused", justify="right")
    table.add_row("hot (resident view)", f"{report['hot_ready_s']:.3f} s", f"{report['hot_pause_ms']:.1f} ms")
    table.add_row(
        "disk slot + reload", f"{report['disk_ready_s']:.3f} s", f"{report['disk_pause_ms']:.1f} ms"
    )
    table.add_row("full reload", f"{report['reload_ready_s']:.3f} s", f"{report['reload_pause_ms']:.1f} ms")
    console.print(table)
    console.print(
        f"hot path: fetch {report['hot_fetch_s']:.3f} s, decode + verify {report['hot_decode_s']:.3f} s, "
        f"stage {report['hot_stage_s']:.3f} s, commit {report['hot_pause_ms']:.1f} ms "
        f"(max {report['hot_pause_max_ms']:.1f} ms; {report['hot_pause_cpu_ms']:.1f} ms of this process's "
        "CPU: on a busy machine the wall time also holds the waits for a core)"
    )
    bare = report.get("bare_scatter_ms")
    console.print(
        "baselines, the same changes stored unchecked: "
        f"torch's indexed write {report['torch_scatter_ms']:.1f} ms"
        + ("" if bare is None else f", a plain compiled store loop on the commit's threads {bare:.1f} ms")
    )
    console.print(
        f"hot pause {report['pause_ratio']:.1f}x shorter than a full reload's; the disk copy follows "
        f"in {report['hot_disk_s']:.3f} s after the swap; bit-exact: {report['hot_bit_exact']}"
    )
    if "many_tensors" in report:
        many = report["many_tensors"]
        console.print(
            f"{many['tensors']} tensors: hot pause {many['hot_pause_ms']:.1f} ms "
            f"({report['many_tensors_pause_ratio']:.2f}x the {report['tensors']}-tensor view's)"
        )
