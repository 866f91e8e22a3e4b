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

import contextlib
import itertools
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
    import torch

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
    tensors: int | None = None  # the view cut into this many tensors, beside FEW_TENSORS (`run_shapes`)


FEW_TENSORS = 256  # "a few large tensors": what `--tensors N` compares N small ones with


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

    def __init__(
        self,
        traj: Trajectory,
        view_gb: float,
        last_version: int,
        device: str = "cpu",
        tensors: int | None = None,
    ) -> None:
        """`tensors`: the same bytes (the copies one after another) cut into this many flat
        tensors of equal size instead of the trajectory model's own tensors."""
        import torch

        if last_version >= traj.steps:
            raise ValueError(f"a trajectory of {traj.steps} steps holds at most {traj.steps - 1} versions")
        self.copies = max(1, math.ceil(view_gb * 1e9 / traj.view_bytes))
        self.tensors = tensors
        self.offsets = traj.steps - last_version
        self._steps = {s: traj.view(s) for s in range(1, last_version + self.offsets + 1)}
        self._tensors = traj.tensors
        self._copy_elements = traj.view_bytes // 2
        self.state: dict[str, torch.Tensor] = {}
        self._flat: torch.Tensor | None = None
        if tensors is None:
            for j in range(self.copies):
                for t in traj.tensors:
                    self.state[f"copies.{j}.{t.name}"] = torch.empty(
                        t.shape, dtype=torch.bfloat16, device=device
                    )
            return
        self._flat = torch.empty(self.copies * self._copy_elements, dtype=torch.bfloat16, device=device)
        bounds = np.linspace(0, self._flat.numel(), tensors + 1).astype(np.int64)
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            self.state[f"layers.{i}.weight"] = self._flat[a:b]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 2 for t in self.state.values())

    def set_version(self, version: int) -> None:
        """Write the view of `version` into the tensors (the optimizer step: not measured)."""
        import torch

        for j in range(self.copies):
            view = self._steps[1 + version + j % self.offsets]
            at = j * self._copy_elements
            for t in self._tensors:
                src = torch.from_numpy(view[t.name].view(np.int16)).view(torch.bfloat16)
                if self._flat is None:
                    self.state[f"copies.{j}.{t.name}"].copy_(src.view(t.shape))
                else:
                    self._flat[at : at + src.numel()].copy_(src.reshape(-1))
                    at += src.numel()


WARM_SHARE = 64  # a warm-up view holds this share of the copies of the view it warms up


def warm_view(traj: Trajectory, view: TiledView, device: str) -> TiledView:
    """A `WARM_SHARE`-th of `view`'s copies (one at least), cut into tensors of its size; on
    CUDA `view` itself: Triton compiles a kernel again for each new specialisation of its
    integer arguments (sizes, counts: divisible by 16 or not), which a smaller view does
    not meet. A fresh H200 run of `--tensors 20000` took 1.15 s for the 256-tensor delta
    warmed up on a small view and 0.19 s once warmed up."""
    if device != "cpu":
        return view
    copies = max(1, view.copies // WARM_SHARE)
    tensors = None if view.tensors is None else max(1, round(view.tensors * copies / view.copies))
    # just under `copies` copies: TiledView rounds the size up to whole copies
    return TiledView(traj, (copies - 0.5) * traj.view_bytes / 1e9, 1, device, tensors=tensors)


def warm_up(url: str, token: str, traj: Trajectory, view: TiledView, device: str) -> None:
    """A keyframe and a delta of a small view cut as `view` is (tensors of the same size),
    untimed, straight to the board, so that no timed publish pays for compiling the
    codec's kernels: numba keeps them on disk, but drops them whenever a codec source
    changed (`codec.kernel_cache`), and a fresh copy of the tree has none. Without it, the
    first run after either compiled them inside the first timed delta, which in
    `run_shapes` is the many-tensor one (docs/design.md has the case)."""
    small = warm_view(traj, view, device)
    run = f"warm-up-{small.tensors or 'model'}"
    from deltaboard.publisher.publisher import Publisher

    with Publisher(url, run, token=token, keyframe_every=10**6, lease_ttl_s=120, assets={}) as pub:
        for v in range(2):
            small.set_version(v)
            pub.publish(small.state, step=v).result()


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


def _trajectory(config: BenchConfig, progress: Callable[[str], None]) -> Trajectory:
    progress(f"trajectory ({config.size}, fp32-master, lr {config.lr:g})")
    return load_trajectory(
        size=config.size,
        regime="fp32-master",
        lr=config.lr,
        steps=config.steps,
        warmup_steps=config.warmup_steps,
        cache=config.cache,
    )


def run(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run both series per link; returns the JSON report (headline: the first link)."""
    import torch

    torch.set_num_threads(2)
    traj = _trajectory(config, progress)
    view = TiledView(traj, config.view_gb, max(config.deltas, config.fulls - 1), config.device)
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="deltaboard-bench-") as tmp,
        board_process(Path(tmp)) as (url, token),
    ):
        warm_up(url, token, traj, view, config.device)
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


def run_shapes(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """The same view cut into `config.tensors` tensors and into `FEW_TENSORS`: a keyframe
    then `config.deltas` deltas of each, alternating shape version by version (so that both
    see the same machine load), across the first link. Per shape (medians over the deltas):
    `blocked_ms`, `e2e_s` (call to commit) and its parts `diff_s` (waiting for the diff),
    `encode_s` (diff, encode and upload, and the board's prepare of the manifest, which runs
    while the last blob uploads), `commit_s`; `delta_bytes`, `manifest_bytes`.
    `many_over_few`: the e2e ratio of the two shapes (the issue's target: within 1.5x).

    Beside each publish, what the snapshot copy alone costs, in the same run (`SnapshotCopy`):
    `torch_copy_ms`, the trainer thread's time in torch's multi-tensor copy of the same
    tensors into one buffer (`torch._foreach_copy_`), and `copy_floor_ms`, one copy of the
    view's bytes as a single tensor, waited for: the blocked time's targets ("no more than
    the snapshot copy") against the copy of these tensors and against the copy of their bytes.
    (Two more buffers of the view's size per shape, on the view's device.)"""
    import torch

    from deltaboard.publisher.publisher import Publisher

    assert config.tensors is not None
    torch.set_num_threads(2)
    traj = _trajectory(config, progress)
    shapes = (config.tensors, FEW_TENSORS)
    views = {n: TiledView(traj, config.view_gb, config.deltas, config.device, tensors=n) for n in shapes}
    series: dict[int, list[tuple[PublishResult, float]]] = {n: [] for n in shapes}
    copies = {n: SnapshotCopy(views[n].state) for n in shapes}
    copy_times: dict[int, list[tuple[float, float]]] = {n: [] for n in shapes}
    gbit = config.links_gbit[0]
    with (
        tempfile.TemporaryDirectory(prefix="deltaboard-bench-") as tmp,
        board_process(Path(tmp)) as (url, token),
    ):
        for n in shapes:
            progress(f"warming up: {n} tensors")
            warm_up(url, token, traj, views[n], config.device)
        host, port = url.rsplit(":", 1)
        with (
            LinkProcess(host.removeprefix("http://"), int(port), gbit) as link,
            contextlib.ExitStack() as stack,
        ):
            pubs = {
                n: stack.enter_context(
                    Publisher(
                        link.url, f"shape-{n}", token=token, keyframe_every=10**6, lease_ttl_s=120, assets={}
                    )
                )
                for n in shapes
            }
            for v in range(config.deltas + 1):
                for n in shapes:
                    progress(f"{gbit:g} Gbit/s: {n} tensors, version {v}")
                    views[n].set_version(v)
                    t0 = time.perf_counter()
                    fut = pubs[n].publish(views[n].state, step=v)
                    blocked = time.perf_counter() - t0
                    series[n].append((fut.result(), blocked))
                    if v:
                        copy_times[n].append(copies[n].timed())
    rows = []
    for n in shapes:
        deltas = [(r, b) for r, b in series[n] if r.kind == "delta"]
        rows.append(
            {
                "tensors": n,
                "blocked_ms": statistics.median(b for _, b in deltas) * 1e3,
                "torch_copy_ms": statistics.median(t for t, _ in copy_times[n]) * 1e3,
                "copy_floor_ms": statistics.median(f for _, f in copy_times[n]) * 1e3,
                **{
                    key: statistics.median(getattr(r, key) for r, _ in deltas)
                    for key in ("e2e_s", "diff_s", "encode_s", "commit_s")
                },
                "delta_bytes": int(statistics.median(r.encoded_bytes for r, _ in deltas)),
                "manifest_bytes": int(statistics.median(r.manifest_bytes for r, _ in deltas)),
                "changed_fraction": statistics.median(
                    r.changed_elements / r.total_elements for r, _ in deltas
                ),
            }
        )
    return {
        "view_gb": views[shapes[0]].nbytes / 1e9,
        "link_gbit": gbit,
        "device": config.device,
        "shapes": rows,
        "many_over_few": rows[0]["e2e_s"] / rows[1]["e2e_s"],
        "source": f"tiled {config.size} AdamW trajectory (fp32-master, lr {config.lr:g}), "
        "cut into equal tensors",
    }


class SnapshotCopy:
    """What the snapshot copy alone costs for a state dict (`run_shapes`), into buffers made
    once: torch's multi-tensor copy of its tensors into views of one buffer, and one copy of
    the same bytes as a single tensor (the bytes' floor). Torch's copy passes floats through
    a conversion that a snapshot cannot use (`snapshot.ViewBuffer.fill`): a time reference,
    not an alternative."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        import torch

        self.sources = list(state.values())
        first = self.sources[0]
        sizes = [t.numel() for t in self.sources]
        self.target = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        starts = itertools.accumulate(sizes[:-1], initial=0)
        self.targets = [
            self.target[a : a + t.numel()].view(t.shape) for a, t in zip(starts, self.sources, strict=True)
        ]
        self.whole = torch.empty_like(self.target)
        self.timed()  # untimed: the buffers' first touch (page faults) and torch's set-up

    def timed(self) -> tuple[float, float]:
        """(seconds in `torch._foreach_copy_` of the tensors: the caller's thread, which on
        CUDA only queues the copies; seconds for one copy of their bytes, finished)."""
        import torch

        on_cuda = self.target.is_cuda
        t0 = time.perf_counter()
        torch._foreach_copy_(self.targets, self.sources)
        multi = time.perf_counter() - t0
        if on_cuda:
            torch.cuda.synchronize(self.target.device)
        t0 = time.perf_counter()
        self.whole.copy_(self.target)
        if on_cuda:
            torch.cuda.synchronize(self.target.device)
        return multi, time.perf_counter() - t0


def render_shapes(report: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"publish: {report['view_gb']:.2f} GB bf16 view at {report['link_gbit']:g} Gbit/s, "
        f"many small tensors vs a few large ({report['many_over_few']:.2f}x)"
    )
    for col in (
        "tensors",
        "changed",
        "blocked ms",
        "torch copy ms",
        "copy floor ms",
        "e2e s",
        "diff s",
        "encode s",
        "commit s",
        "delta B",
        "manifest B",
    ):
        table.add_column(col, justify="right")
    for r in report["shapes"]:
        table.add_row(
            f"{r['tensors']:,}",
            f"{r['changed_fraction']:.2%}",
            f"{r['blocked_ms']:.1f}",
            f"{r['torch_copy_ms']:.1f}",
            f"{r['copy_floor_ms']:.1f}",
            f"{r['e2e_s']:.3f}",
            f"{r['diff_s']:.3f}",
            f"{r['encode_s']:.3f}",
            f"{r['commit_s']:.3f}",
            f"{r['delta_bytes']:,}",
            f"{r['manifest_bytes']:,}",
        )
    console.print(table)


LLAMA_LAYER = (  # one decoder layer of a Llama-3-8B-like model: (name, shape)
    ("self_attn.q_proj.weight", (4096, 4096)),
    ("self_attn.k_proj.weight", (1024, 4096)),
    ("self_attn.v_proj.weight", (1024, 4096)),
    ("self_attn.o_proj.weight", (4096, 4096)),
    ("mlp.gate_proj.weight", (14336, 4096)),
    ("mlp.up_proj.weight", (14336, 4096)),
    ("mlp.down_proj.weight", (4096, 14336)),
    ("input_layernorm.weight", (4096,)),
    ("post_attention_layernorm.weight", (4096,)),
)


def shaped_tensors(view_gb: float, model: bool, scale: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of a bf16 view of `view_gb`: 64 MiB matrices, or (`model`) a Llama-like mix
    of large and small tensors (embeddings, 9 tensors a layer, norms; `scale` divides every
    dimension of 4096 and more, for small views)."""
    if not model:
        shape = (4096, 8192)
        return [(f"w{i}", shape) for i in range(max(1, round(view_gb * 1e9 / (2 * shape[0] * shape[1]))))]

    def scaled(shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(d // scale if d >= 4096 else d for d in shape)

    layer = [(name, scaled(shape)) for name, shape in LLAMA_LAYER]
    ends = [("model.embed_tokens.weight", scaled((128256, 4096))), ("lm_head.weight", scaled((128256, 4096)))]
    per_layer = sum(2 * math.prod(s) for _, s in layer)
    layers = max(1, round((view_gb * 1e9 - sum(2 * math.prod(s) for _, s in ends)) / per_layer))
    out = [ends[0]]
    out += [(f"model.layers.{i}.{name}", shape) for i in range(layers) for name, shape in layer]
    return [*out, ("model.norm.weight", scaled((4096,))), ends[1]]


def device_throughput(
    view_gb: float,
    device: str,
    changed_fraction: float = 0.01,
    repeats: int = 3,
    hints: bool = False,
    fused: bool = False,
    model: bool = False,
) -> dict[str, Any]:
    """Snapshot + diff of a bf16 view on `device` (what one version costs before encoding).

    The view is 64 MiB tensors, or a model-shaped list (`shaped_tensors`). Between
    versions a `changed_fraction` of elements moves by one ULP, small weights (|w| < 0.01)
    ten times as often as the others, as an AdamW step's changes favour small weights, so
    that the context classes pay off and `hints` computes ranks too. `fused`: the Triton
    pass, else the torch reference. Medians over `repeats` versions after one untimed (the
    first pays for pinned host memory and kernel builds); the device is synchronised
    around each timed stage.
    """
    import torch

    from deltaboard.board.contract.schemas import ViewSpec
    from deltaboard.publisher.device_diff import diff_views
    from deltaboard.publisher.snapshot import ViewBuffer, ViewLayout

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    g = torch.Generator(device=device).manual_seed(0)
    tensors = shaped_tensors(view_gb, model, scale=1 if view_gb >= 1 else 8)
    state = {
        name: (torch.randn(shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
        for name, shape in tensors
    }
    layout = ViewLayout.of(state, ViewSpec())
    base, snap = ViewBuffer(layout), ViewBuffer(layout)
    base.fill(state)
    snapshot_s, diff_s, host_bytes, hint_bytes, changed = [], [], [], [], []
    rate = changed_fraction / (10 * 0.383 + 0.617)  # 38.3% of N(0, 0.02) lies under 0.01
    for i in range(repeats + 1):  # the first version warms up (pinned host blocks, kernels): untimed
        for t in state.values():  # the optimizer step: a few elements move by one ULP
            p = torch.where(t.abs() < 0.01, 10 * rate, rate)
            t.view(torch.int16).add_((torch.rand(t.shape, generator=g, device=device) < p).to(torch.int16))
        sync()
        t0 = time.perf_counter()
        snap.fill(state)
        sync()
        t1 = time.perf_counter()
        d = diff_views(base, snap, hints, fused)
        sync()
        t2 = time.perf_counter()
        base, snap = snap, base
        if i == 0:
            continue
        snapshot_s.append(t1 - t0)
        diff_s.append(t2 - t1)
        host_bytes.append(d.host_bytes)
        hint_bytes.append(d.hint_bytes)
        changed.append(d.changed_elements)
    gb = layout.view_bytes / 1e9
    snap_med, diff_med = statistics.median(snapshot_s), statistics.median(diff_s)
    return {
        "pass": "fused" if fused else "torch",
        "shape": f"model-shaped ({len(tensors)} tensors)" if model else f"{len(tensors)} x 64 MiB",
        "tensors": len(tensors),
        "view_gb": gb,
        "hints": hints,
        "changed_fraction": statistics.median(changed) / (layout.view_bytes / 2),
        "snapshot_gbps": gb / snap_med,
        "diff_gbps": gb / diff_med,
        "snapshot_diff_gbps": gb / (snap_med + diff_med),
        "host_bytes": int(statistics.median(host_bytes)),
        "hint_bytes": int(statistics.median(hint_bytes)),
    }


def copy_limit(device: str, gb: float = 4.0, repeats: int = 5) -> dict[str, Any]:
    """A device-to-device copy of `gb`, counting bytes read and written: the memory bandwidth
    the pass is held against. Snapshot + diff moves three view-sized streams at least (the
    new view read, the snapshot written, the old view read), so `view_limit_gbps` is a third."""
    import torch

    src = torch.empty(int(gb * 1e9) // 2, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rw = 2 * src.numel() * 2 / 1e9 / statistics.median(times)
    return {"copy_gbps": rw, "view_limit_gbps": rw / 3}


def throughput(sizes_gb: tuple[float, ...], model_gb: float, device: str, repeats: int = 3) -> dict[str, Any]:
    """Every figure of `bench publish --throughput`: per view (64 MiB tensors of each size in
    `sizes_gb`, and a model-shaped list of `model_gb`), the fused pass (where Triton runs on
    `device`) and the torch reference, each without and with context hints; and the copy limit."""
    import torch

    from deltaboard.publisher import fused_diff

    passes = [True, False] if fused_diff.available(device) else [False]
    rows = []
    for gb, model in [*((gb, False) for gb in sizes_gb), (model_gb, True)]:
        for fused in passes:
            for hints in (False, True):
                try:
                    rows.append(
                        device_throughput(gb, device, repeats=repeats, hints=hints, fused=fused, model=model)
                    )
                except Exception as exc:  # one failed configuration still leaves the others' figures
                    rows.append(
                        {
                            "pass": "fused" if fused else "torch",
                            "view_gb": gb,
                            "hints": hints,
                            "error": repr(exc),
                        }
                    )
    return {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        **copy_limit(device, gb=min(4.0, max(sizes_gb))),
        "rows": rows,
    }


def render_throughput(report: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"snapshot + diff on {report['device']}: copy {report['copy_gbps']:,.0f} GB/s read+written, "
        f"limit {report['view_limit_gbps']:,.0f} GB/s of view"
    )
    for col in (
        "view",
        "GB",
        "pass",
        "hints",
        "changed",
        "snapshot GB/s",
        "diff GB/s",
        "snap+diff GB/s",
        "host B",
    ):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        if "error" in r:
            console.print(f"[red]{r['pass']} pass, {r['view_gb']:g} GB, hints {r['hints']}: {r['error']}[/]")
            continue
        table.add_row(
            r["shape"],
            f"{r['view_gb']:.2f}",
            r["pass"],
            "yes" if r["hints"] else "no",
            f"{r['changed_fraction']:.2%}",
            f"{r['snapshot_gbps']:,.1f}",
            f"{r['diff_gbps']:,.1f}",
            f"{r['snapshot_diff_gbps']:,.1f}",
            f"{r['host_bytes']:,}",
        )
    console.print(table)


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
