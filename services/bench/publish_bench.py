"""`deltaboard bench publish`: deltas against full checkpoints, across an emulated link.

The view is **derived from a real AdamW trajectory** (`deltaboard.services.trajectory`: a Llama-style
model trained with AdamW, fp32 master weights, bf16 view, lr 1e-6): the trajectory's
bf16 view is tiled into as many copies as it takes to reach `view_gb`, and copy j at
version v holds the trajectory's view at step `1 + v + (j mod offsets)`. So every
version-to-version change is a real optimizer step's change (changed fraction, the
positions' magnitude dependence, ULP sizes), while copies are at different steps so that
no two copies change the same way.

Two runs go through the same board, behind the same rate-limited proxy (its own
process): `delta` (a keyframe, then one delta per version) and `full` (every version a
keyframe: what shipping whole checkpoints costs). Figures per link (medians):

* `blocked_ms`: the trainer thread's time inside `publish()` (the snapshot copy);
* `delta_e2e_s` / `full_e2e_s`: from the `publish()` call to the commit;
* `delta_bytes` / `full_bytes`: encoded bytes uploaded per version.
"""

from __future__ import annotations

import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from deltaboard.services.bench.link import LinkProcess, free_port
from deltaboard.services.trajectory import DEFAULT_CACHE, Trajectory, load_trajectory

if TYPE_CHECKING:
    from deltaboard.publisher.publisher import PublishResult


@dataclass(frozen=True)
class BenchConfig:
    view_gb: float = 1.0
    links_gbit: tuple[float, ...] = (1.0, 10.0)
    deltas: int = 3
    fulls: int = 2
    size: str = "bench"
    lr: float = 1e-6
    steps: int = 10
    warmup_steps: int = 16  # as `bench codec`: Adam's state settled, as in post-training
    device: str = "cpu"  # where the trainer's tensors live (cuda: the snapshot and diff run there)
    cache: Path = DEFAULT_CACHE


QUICK = BenchConfig(view_gb=0.0625, deltas=2, fulls=1, size="tiny")


@contextmanager
def board_process(data_dir: Path) -> Iterator[tuple[str, str]]:
    """A board (`python -m deltaboard.board.server.api`) on a loopback port; yields (url, publish token)."""
    port, token = free_port(), f"bench-{secrets.token_hex(8)}"
    env = {
        **os.environ,
        "DELTABOARD_DATA_DIR": str(data_dir),
        "DELTABOARD_PORT": str(port),
        "DELTABOARD_HOST": "127.0.0.1",
        "DELTABOARD_TOKENS": f"publish:{token}",
    }
    log = open(data_dir / "board.log", "ab")  # noqa: SIM115 - kept open for the process' lifetime
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaboard.board.server.api"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the board exited ({proc.returncode}); see {data_dir / 'board.log'}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the board did not start")
            time.sleep(0.1)
        yield url, token
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


class TiledView:
    """The synthetic trainer: tiled trajectory views as bf16 tensors, moved version by version."""

    def __init__(self, traj: Trajectory, view_gb: float, last_version: int, device: str = "cpu") -> None:
        import torch

        if last_version >= traj.steps:
            raise ValueError(f"a trajectory of {traj.steps} steps holds at most {traj.steps - 1} versions")
        self.copies = max(1, math.ceil(view_gb * 1e9 / traj.view_bytes))
        self.offsets = traj.steps - last_version
        self._steps = {s: traj.view(s) for s in range(1, last_version + self.offsets + 1)}
        self.state: dict[str, torch.Tensor] = {}
        for j in range(self.copies):
            for t in traj.tensors:
                self.state[f"copies.{j}.{t.name}"] = torch.empty(t.shape, dtype=torch.bfloat16, device=device)
        self._tensors = traj.tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 2 for t in self.state.values())

    def set_version(self, version: int) -> None:
        """Write the view of `version` into the tensors (the optimizer step: not measured)."""
        import torch

        for j in range(self.copies):
            view = self._steps[1 + version + j % self.offsets]
            for t in self._tensors:
                src = torch.from_numpy(view[t.name].view(np.int16)).view(torch.bfloat16).view(t.shape)
                self.state[f"copies.{j}.{t.name}"].copy_(src)


def _publish_series(
    url: str, token: str, run: str, view: TiledView, versions: range, keyframe_every: int
) -> list[tuple[PublishResult, float]]:
    """Publish `versions` one at a time; each result with the caller's time inside publish()."""
    from deltaboard.publisher.publisher import Publisher

    out = []
    with Publisher(url, run, token=token, keyframe_every=keyframe_every, lease_ttl_s=120, assets={}) as pub:
        for v in versions:
            view.set_version(v)
            t0 = time.perf_counter()
            fut = pub.publish(view.state, step=v)
            blocked = time.perf_counter() - t0
            out.append((fut.result(), blocked))
    return out


def run(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run both series per link; returns the JSON report (headline: the first link)."""
    import torch

    torch.set_num_threads(2)
    progress(f"trajectory ({config.size}, fp32-master, lr {config.lr:g})")
    traj = load_trajectory(
        size=config.size,
        regime="fp32-master",
        lr=config.lr,
        steps=config.steps,
        warmup_steps=config.warmup_steps,
        cache=config.cache,
    )
    view = TiledView(traj, config.view_gb, max(config.deltas, config.fulls - 1), config.device)
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="deltaboard-bench-") as tmp,
        board_process(Path(tmp)) as (url, token),
    ):
        host, port = url.rsplit(":", 1)
        for gbit in config.links_gbit:
            with LinkProcess(host.removeprefix("http://"), int(port), gbit) as link:
                progress(f"{gbit:g} Gbit/s: keyframe + {config.deltas} deltas")
                series = _publish_series(
                    link.url, token, f"delta-{gbit:g}", view, range(config.deltas + 1), 10**6
                )
                deltas = [(r, blocked) for r, blocked in series if r.kind == "delta"]
                progress(f"{gbit:g} Gbit/s: {config.fulls} full checkpoints")
                fulls = _publish_series(link.url, token, f"full-{gbit:g}", view, range(config.fulls), 1)
            results.append(
                {
                    "view_gb": view.nbytes / 1e9,
                    "changed_fraction": statistics.median(
                        r.changed_elements / r.total_elements for r, _ in deltas
                    ),
                    "link_gbit": gbit,
                    "blocked_ms": statistics.median(blocked for _, blocked in deltas) * 1e3,
                    "delta_e2e_s": statistics.median(r.e2e_s for r, _ in deltas),
                    "full_e2e_s": statistics.median(r.e2e_s for r, _ in fulls),
                    "delta_bytes": int(statistics.median(r.encoded_bytes for r, _ in deltas)),
                    "full_bytes": int(statistics.median(r.encoded_bytes for r, _ in fulls)),
                    "device": config.device,
                    "source": f"tiled {config.size} AdamW trajectory (fp32-master, lr {config.lr:g}, "
                    f"after {config.warmup_steps} warm-up steps)",
                }
            )
    return {**results[0], "results": results}


def device_throughput(
    view_gb: float,
    device: str,
    changed_fraction: float = 0.01,
    repeats: int = 5,
    hints: bool | None = None,
) -> dict[str, Any]:
    """Snapshot + diff of a bf16 view on `device` (what one version costs before encoding).

    The view is 64 MiB tensors of bf16 parameters; between versions a `changed_fraction`
    of elements moves by one ULP. Medians over `repeats` versions; the device is
    synchronised around each timed stage. `hints` as `diff_views` (default: on off the host).
    The changes do not depend on the exponent, so the context classes never pay off here:
    the hint costs its exponent counts and the host's threshold search but no ranks. An
    AdamW step's changes favour small weights; then every tensor's ranks are computed too,
    which this figure leaves out (`hint_bytes` is 0 beyond the counts).
    """
    import torch

    from deltaboard.board.contract.schemas import ViewSpec
    from deltaboard.publisher.device_diff import diff_views
    from deltaboard.publisher.snapshot import ViewBuffer, ViewLayout

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    shape = (4096, 8192)
    count = max(1, round(view_gb * 1e9 / (2 * shape[0] * shape[1])))
    g = torch.Generator(device=device).manual_seed(0)
    state = {f"w{i}": torch.randn(shape, generator=g, device=device).to(torch.bfloat16) for i in range(count)}
    layout = ViewLayout.of(state, ViewSpec())
    base, snap = ViewBuffer(layout), ViewBuffer(layout)
    base.fill(state)
    snapshot_s, diff_s, host_bytes, hint_bytes, changed = [], [], [], [], []
    for _ in range(repeats):
        for t in state.values():  # the optimizer step: a few elements move by one ULP
            bits = t.view(torch.int16)
            bits.add_((torch.rand(shape, generator=g, device=device) < changed_fraction).to(torch.int16))
        sync()
        t0 = time.perf_counter()
        snap.fill(state)
        sync()
        t1 = time.perf_counter()
        d = diff_views(base, snap, hints)
        sync()
        t2 = time.perf_counter()
        snapshot_s.append(t1 - t0)
        diff_s.append(t2 - t1)
        host_bytes.append(d.host_bytes)
        hint_bytes.append(d.hint_bytes)
        changed.append(d.changed_elements)
        base, snap = snap, base
    gb = layout.view_bytes / 1e9
    snap_med, diff_med = statistics.median(snapshot_s), statistics.median(diff_s)
    return {
        "device": device if not device.startswith("cuda") else torch.cuda.get_device_name(),
        "view_gb": gb,
        "changed_fraction": statistics.median(changed) / (layout.view_bytes / 2),
        "snapshot_gbps": gb / snap_med,
        "diff_gbps": gb / diff_med,
        "snapshot_diff_gbps": gb / (snap_med + diff_med),
        "host_bytes": int(statistics.median(host_bytes)),
        "hints": hints if hints is not None else device != "cpu",
        "hint_bytes": int(statistics.median(hint_bytes)),
    }


def render(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"publish: {report['view_gb']:.2f} GB bf16 view, {report['source']}")
    for col in (
        "link Gbit/s",
        "changed",
        "blocked ms",
        "delta e2e s",
        "full e2e s",
        "full/delta",
        "delta B",
        "full B",
    ):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(
            f"{r['link_gbit']:g}",
            f"{r['changed_fraction']:.2%}",
            f"{r['blocked_ms']:.1f}",
            f"{r['delta_e2e_s']:.3f}",
            f"{r['full_e2e_s']:.2f}",
            f"{r['full_e2e_s'] / r['delta_e2e_s']:.1f}x",
            f"{r['delta_bytes']:,}",
            f"{r['full_bytes']:,}",
        )
    console.print(table)
