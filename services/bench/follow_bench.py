"""`deltaboard bench follow`: what a rollout node pays to keep up.

The view is **synthetic, with the change statistics of a real AdamW trajectory**: bf16
weights drawn from N(0, 0.02) (a Llama init), changed per version the way
`deltaboard.services.trajectory`'s recorded run (a tiny Llama, fp32 master weights, lr 1e-6, warm
Adam) changes its bf16 view: the probability that a weight changes depends on its old
exponent as measured there (it about doubles each time |w| halves: Adam's step is ~lr
whatever |w|, so small weights cross bf16 rounding boundaries far more often), scaled to
the configured changed fraction, and each change is a signed ULP step drawn from the
steps observed there (~90% one ULP). Small weights are scattered over every matrix, so
nearly every 4 KiB page of every shard is still touched per version (`pages_touched`),
as in the recorded run. The versions go through the real publisher and a real board
process (loopback); the nodes are real `Follower`s on local disk. Figures:

* `full_write_s`: writing the whole checkpoint the way a node without deltaboard does
  (new safetensors files, the follower's own shard files and headers, written into the
  page cache like the follower's patches are; neither is fsynced): the fastest of five
  runs, all in `full_write_runs_s`;
* `apply_verify_s`: per version, from the end of the download to the swap: decode, verify
  (O(changes)) and write only the changed elements in place (median over steady updates);
  `codec_decode_s` is the codec's decode + verify of one version alone (one thread, in
  memory, nothing written), and `codec_decode_threads_s` the same on the follower's
  apply threads: the floor under it; `page_touch_s` is the other floor: one write into
  every 4 KiB page of freshly written shards through a fresh mapping (no data), which any
  in-place apply pays when nearly every page holds a change (`pages_touched`);
  `mirror_s` is the follower's second write of the same changes into its other slot (the
  A/B scheme's price for atomic versions), after the swap, off the critical path;
* `bootstrap_s`: an empty node to serving the head with the compaction worker running:
  the worker's keyframe of head, its tensors' ranges fetched in parallel and each decoded
  and written as it arrives (`bootstrap_bytes`, `bootstrap_strategy`); the baseline of the
  same run, `bootstrap_deltas_s`, is the same node before the worker ran (the run's one
  trainer keyframe plus every delta after it: the worst case of a keyframe schedule;
  download included), and `bootstrap_keyframe_s` to serving the trainer keyframe's version
  itself; `keyframe_build_s` is the worker building and registering its keyframe;
  `bootstrap_cpu_per_gb`: CPU seconds per GB of view that the node (this process, from the
  sync call to serving) and the board process spent on that bootstrap, beside the floors
  measured in the same run (`floor_cpu_per_gb`): copying the view's bytes into fresh memory
  (page faults and one copy: what writing the shards at least costs) and reading them over
  loopback TCP from memory (both ends: what receiving them at least costs);
* `catchup_*`: a node k = 32 versions behind, on the plan once the spans ending at k
  are registered (`catchup_s`, `catchup_bytes`, of which `span_bytes` in spans; the
  node's CPU seconds to serving `catchup_cpu_s`, its span decoded on `ranged_threads`;
  after one untimed catch-up of another node, so that the compiled kernels are loaded as
  in a running node; `codec_decode_s` likewise decodes one patch first), and
  the same node by the deltas alone, before they were (`catchup_deltas_s`,
  `catchup_deltas_bytes`); against one keyframe (`keyframe_bytes`) and all k deltas'
  encoded bytes (`replay_bytes`). `compact_s`: building and registering the spans of one
  head, as the compaction worker does on that head's event (here in-process), by a worker
  that starts there (it walks every delta of the head's longest span), and
  `compact_incremental_s` the next head on the same worker (one delta decoded, the spans
  composed from the window it keeps; `compact_threads` tensors at once).
"""

from __future__ import annotations

import mmap
import os
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from deltaboard.board.contract.schemas import TensorEntry
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower import Follower
from deltaboard.clients.follower.follower import APPLY_THREADS, RANGED_THREADS
from deltaboard.clients.follower.layout import materialize
from deltaboard.clients.follower.patcher import read_placements
from deltaboard.services.bench.publish_bench import board_process
from deltaboard.services.compact.build import SpanBuilder
from deltaboard.services.compact.worker import compact_head, keyframe_head

RUN = "bench-follow"
PAGE = 4096
Status = Callable[[str], None]


@dataclass(frozen=True)
class BenchConfig:
    view_gb: float = 1.0
    changed_fraction: float = 0.01
    catchup_k: int = 32
    steady: int = 4  # versions measured one at a time after the catch-up
    tensor_elements: int = 8 * 2**20  # 16 MiB bf16 tensors, a large LM's matrix scale
    seed: int = 0


QUICK = BenchConfig(view_gb=0.125, catchup_k=32, steady=3)


# The recorded run whose change statistics the view follows (trained once, cached under .bench/).
TRAJECTORY_LR, TRAJECTORY_STEPS, TRAJECTORY_WARMUP = 1e-6, 10, 16
# Exponents with fewer weights than this in the recorded run borrow the nearest measured rate.
MIN_WEIGHTS = 1000
# Weights changing with a probability above this are drawn from a list kept per tensor;
# the others by rejection from this fraction of uniform candidates (no full pass per step).
BULK_CAP = 0.05
MAX_STEP = 64  # ULPs: clips the recorded run's rare large steps


def _ordered(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns as integers in value order (one apart = one ULP apart)."""
    magnitude = (bits & 0x7FFF).astype(np.int32)
    return np.where(bits & 0x8000, -magnitude, magnitude)


def _unordered(values: np.ndarray) -> np.ndarray:
    return np.where(values < 0, 0x8000 | -values, values).astype(np.uint16)


def _exponents(bits: np.ndarray) -> np.ndarray:
    """bf16 exponent fields, one byte each (the cast drops the sign bit: a tenth of the
    time and memory of masking into index-sized integers, on views of gigabytes)."""
    return (bits >> 7).astype(np.uint8)


@dataclass(frozen=True)
class ChangeStats:
    """How the recorded run changes its bf16 view per step: `rate[e]` the fraction of the
    weights with exponent field `e` that change, `steps` the signed ULP steps seen."""

    rate: np.ndarray
    steps: np.ndarray
    fraction: float
    source: str


def trajectory_stats() -> ChangeStats:
    """Measure `ChangeStats` on the recorded trajectory (trained once, then cached)."""
    from deltaboard.services.trajectory import load_trajectory

    trajectory = load_trajectory(
        size="tiny",
        regime="fp32-master",
        lr=TRAJECTORY_LR,
        steps=TRAJECTORY_STEPS,
        warmup_steps=TRAJECTORY_WARMUP,
    )
    bf16 = [t.name for t in trajectory.tensors if t.dtype == "BF16"]

    def flat(step: int) -> np.ndarray:
        view = trajectory.view(step)
        return np.concatenate([view[name].view(np.uint16) for name in bf16])

    weights, changed = np.zeros(256), np.zeros(256)
    steps = []
    before = flat(0)
    for step in range(1, trajectory.steps + 1):
        after = flat(step)
        moved = np.flatnonzero(before != after)
        weights += np.bincount(_exponents(before), minlength=256)
        changed += np.bincount(_exponents(before[moved]), minlength=256)
        steps.append(_ordered(after[moved]) - _ordered(before[moved]))
        before = after
    measured = np.flatnonzero(weights >= MIN_WEIGHTS)
    nearest = measured[np.abs(np.arange(256)[:, None] - measured[None, :]).argmin(axis=1)]
    rate = changed[nearest] / weights[nearest]
    return ChangeStats(
        rate=rate,
        steps=np.clip(np.concatenate(steps), -MAX_STEP, MAX_STEP),
        fraction=float(changed.sum() / weights.sum()),
        source=f"tiny Llama, fp32 master weights, AdamW lr {TRAJECTORY_LR:g}, {TRAJECTORY_STEPS} steps",
    )


class SyntheticTrainer:
    """bf16 tensors (numpy-backed, shared with torch) changed per step with `ChangeStats`
    scaled to `config.changed_fraction`."""

    def __init__(self, config: BenchConfig, stats: ChangeStats) -> None:
        import torch

        self.rng = np.random.default_rng(config.seed)
        self.stats = stats
        count = max(1, round(config.view_gb * 1e9 / 2 / config.tensor_elements))
        cols = 4096
        rows = max(1, config.tensor_elements // cols)

        def draw(i: int) -> tuple[np.ndarray, np.ndarray]:
            """Tensor i from a generator of its own (the same bits whichever thread draws
            it) and its exponents' histogram."""
            weights = torch.randn(rows, cols, generator=torch.Generator().manual_seed(config.seed + i)) * 0.02
            bits = weights.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(-1)
            return bits, np.bincount(_exponents(bits), minlength=256)

        # One tensor per thread: a view of several GB is minutes of drawing on one core.
        with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="deltaboard-view") as pool:
            drawn = list(pool.map(draw, range(count)))
            self.bits: dict[str, np.ndarray] = {}
            self.state: dict[str, torch.Tensor] = {}
            for i, (bits, _) in enumerate(drawn):
                name = f"layers.{i}.weight"
                self.bits[name] = bits
                self.state[name] = torch.from_numpy(bits).view(torch.bfloat16).view(rows, cols)
            histogram = np.sum([counts for _, counts in drawn], axis=0, dtype=np.float64)
            # the same relative rates, scaled so that this view changes `changed_fraction`
            scale = config.changed_fraction * histogram.sum() / float(histogram @ stats.rate)
            self.p = np.minimum(stats.rate * scale, 1.0)
            hot_exponents = self.p > BULK_CAP
            hot = pool.map(lambda b: np.flatnonzero(hot_exponents[_exponents(b)]), self.bits.values())
            self.hot = dict(zip(self.bits, hot, strict=True))
        self.pages_touched = 0.0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bits.values())

    def _positions(self, name: str, rng: np.random.Generator) -> np.ndarray:
        """Each weight independently with probability `p[its exponent]`: the hot ones
        (listed at init) directly, the rest by rejection from uniform candidates."""
        bits, hot = self.bits[name], self.hot[name]
        candidates = rng.integers(0, bits.size, round(bits.size * BULK_CAP))
        p = self.p[_exponents(bits[candidates])]
        bulk = candidates[(p <= BULK_CAP) & (rng.random(candidates.size) * BULK_CAP < p)]
        hot = hot[rng.random(hot.size) < self.p[_exponents(bits[hot])]]
        positions = np.sort(np.concatenate([bulk, hot]))
        unique: np.ndarray = positions[np.concatenate([[True], positions[1:] != positions[:-1]])]
        return unique

    def _step_tensor(self, name: str, seed: int) -> tuple[int, int]:
        """Change one tensor; (4 KiB pages touched, pages)."""
        bits, rng = self.bits[name], np.random.default_rng(seed)
        positions = self._positions(name, rng)
        moves = rng.choice(self.stats.steps, positions.size)
        bits[positions] = _unordered(_ordered(bits[positions]) + moves)
        page = positions // (PAGE // 2)
        return int(page.size > 0) + int(np.count_nonzero(page[1:] != page[:-1])), -(-bits.size // (PAGE // 2))

    def step(self) -> None:
        """One version: each tensor changed on a thread, from a generator seeded from the
        trainer's own, so that the steps are the same whichever thread runs them."""
        seeds = self.rng.integers(0, 2**63, len(self.bits)).tolist()
        with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="deltaboard-step") as pool:
            touched = list(pool.map(self._step_tensor, self.bits, seeds))
        pages, total = (sum(column) for column in zip(*touched, strict=True))
        self.pages_touched = pages / total


@dataclass
class Timeline:
    """A `Progress` that records when one sync began, when each phase started, when the
    version was served (swap), when the sync ended, and how many bytes it fetched."""

    begun: float = 0.0
    started: dict[str, float] = field(default_factory=dict)
    fetched: int = 0
    served_at: float = 0.0
    ended: float = 0.0
    begun_cpu: float = 0.0
    served_cpu: float = 0.0

    def reset(self) -> None:
        self.begun, self.started, self.fetched = time.perf_counter(), {}, 0
        self.begun_cpu = process_cpu()

    @property
    def ready_s(self) -> float:
        """From the sync call to the new version being served."""
        return self.served_at - self.begun

    @property
    def ready_cpu_s(self) -> float:
        """CPU seconds of this process from the sync call to the new version being served."""
        return self.served_cpu - self.begun_cpu

    @property
    def apply_verify_s(self) -> float:
        """From the start of applying (download done) to the swap."""
        return self.served_at - self.started["apply"]

    @property
    def mirror_s(self) -> float:
        """After the swap: the other slot brought forward, the cache pruned."""
        return self.ended - self.served_at

    def start(self, phase: str, total: int) -> None:
        self.started.setdefault(phase, time.perf_counter())

    def advance(self, phase: str, n: int) -> None:
        if phase == "fetch":
            self.fetched += n

    def served(self, version: int) -> None:
        self.served_at = time.perf_counter()
        self.served_cpu = process_cpu()


def process_cpu() -> float:
    """CPU seconds (user + system) of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def board_cpu() -> float:
    """CPU seconds of this process's children: the bench's board process."""
    return sum(sum(child.cpu_times()[:2]) for child in psutil.Process().children(recursive=True))


def floors(nbytes: int) -> dict[str, float]:
    """CPU seconds per GB of the two floors under a bootstrap of `nbytes` (module docstring)."""
    source = np.ones(nbytes, dtype=np.uint8)
    started = process_cpu()
    np.copyto(np.empty_like(source), source)
    memcpy = process_cpu() - started
    server = socket.create_server(("127.0.0.1", 0))
    receiver = socket.create_connection(server.getsockname())
    sender, _ = server.accept()

    def send() -> None:
        with sender:
            sender.sendall(source.data)

    with server, receiver, ThreadPoolExecutor(1) as pool:
        started = process_cpu()
        sending = pool.submit(send)
        view, got = np.empty_like(source).data, 0
        while got < nbytes and (n := receiver.recv_into(view[got : got + (1 << 20)])):
            got += n
        sending.result()
        loopback = process_cpu() - started
    return {"memcpy_fresh": memcpy * 1e9 / nbytes, "loopback_read": loopback * 1e9 / nbytes}


@dataclass
class Node:
    follower: Follower
    timeline: Timeline

    def sync(self, version: int) -> Timeline:
        self.timeline.reset()
        self.follower.sync(version)
        self.timeline.ended = time.perf_counter()
        return self.timeline


def node(client: BoardClient, directory: Path, name: str) -> Node:
    timeline = Timeline()
    follower = Follower(
        client, RUN, directory, node_id=name, engine="bench", progress=timeline, on_version=timeline.served
    )
    return Node(follower, timeline)


def publish(
    client: BoardClient, trainer: SyntheticTrainer, versions: int, status: Status
) -> tuple[list[Any], dict[str, np.ndarray]]:
    """Publish `versions` versions; the results, and the view before the last step."""
    from deltaboard.publisher.publisher import Publisher

    results = []
    base: dict[str, np.ndarray] = {}
    with Publisher(client, RUN, keyframe_every=10**6, lease_ttl_s=300, assets={}) as pub:
        for v in range(versions):
            status(f"publishing version {v}/{versions - 1}")
            if v == versions - 1:
                base = {name: bits.reshape(-1).view(np.uint8).copy() for name, bits in trainer.bits.items()}
            if v:
                trainer.step()
            results.append(pub.publish(trainer.state).result())
    return results, base


def codec_decode_s(client: BoardClient, version: int, base: dict[str, np.ndarray], threads: int) -> float:
    """The codec's share of one version's apply: decoding (and verifying) every patch of
    `version` against its base in memory, on `threads` threads, nothing written."""
    from deltaboard.board import codec

    manifest = client.manifest(RUN, version)
    blobs = {sha: client.get_blob(RUN, sha) for sha in manifest.blob_shas()}
    digests = {name: codec.digest(data, "BF16") for name, data in base.items()}

    def one(t: TensorEntry) -> None:
        patch = memoryview(blobs[t.blob.sha256])[t.blob.offset : t.blob.offset + t.blob.length]
        codec.decode(patch, base[t.name], digests[t.name])

    one(manifest.tensors[0])  # the compiled kernels loaded (or compiled) before the clock starts
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        list(pool.map(one, manifest.tensors))
        return time.perf_counter() - started


def full_write_runs(
    trainer: SyntheticTrainer, slot_dir: Path, scratch: Path, runs: int = 5
) -> tuple[list[float], list[float]]:
    """Write the view as a node that receives whole checkpoints does: the follower's own
    shard files (same names, headers and tensor order) created anew, like a safetensors
    save, into the page cache. The first runs are often several times slower (the kernel
    finds fresh pages; later runs reuse the pages of the files just deleted), so all are
    reported and the fastest is the figure: the cheapest full write, which makes the
    ratio against it the least flattering.

    After each write, the floor under any in-place apply that changes nearly every page
    is measured on the files just written: one write into each 4 KiB page through a fresh
    writable mapping, the way the follower maps its shards (no data moves: the page
    faults and the dirtying alone). Returns (write times, page-touch times)."""
    shards = []
    for path in sorted(slot_dir.glob("*.safetensors")):
        placements = sorted(read_placements(path).values(), key=lambda p: p.offset)
        prefix = path.read_bytes()[: placements[0].offset] if placements else path.read_bytes()
        shards.append((path.name, prefix, [trainer.bits[name].view(np.uint8) for name in _names(path)]))
    scratch.mkdir()
    writes, touches = [], []
    for _ in range(runs):
        started = time.perf_counter()
        for name, prefix, tensors in shards:
            with open(scratch / name, "wb") as f:
                f.write(prefix)
                for data in tensors:
                    f.write(data.data)
        writes.append(time.perf_counter() - started)
        started = time.perf_counter()
        for name, _, _ in shards:
            with open(scratch / name, "r+b") as shard, mmap.mmap(shard.fileno(), 0) as mapped:
                pages = np.frombuffer(mapped, dtype=np.uint8)[::PAGE]
                pages += np.uint8(0)  # a write fault on every page, the contents unchanged
                del pages
        touches.append(time.perf_counter() - started)
        for name, _, _ in shards:
            (scratch / name).unlink()
    return writes, touches


def _names(shard: Path) -> list[str]:
    """A shard's tensor names in file order."""
    placements = read_placements(shard)
    return sorted(placements, key=lambda name: placements[name].offset)


def run(config: BenchConfig, status: Status) -> dict[str, Any]:
    k = config.catchup_k
    with tempfile.TemporaryDirectory(prefix="deltaboard-bench-follow-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "board").mkdir()
        status("measuring the change statistics of a recorded AdamW trajectory")
        stats = trajectory_stats()
        status("generating the view")
        trainer = SyntheticTrainer(config, stats)
        with board_process(tmp / "board") as (url, token), BoardClient(url, token) as client:
            results, base = publish(client, trainer, 1 + k + config.steady, status)
            status("writing the full checkpoint")
            (tmp / "layout").mkdir()
            materialize(tmp / "layout", client.manifest(RUN, 0), {})
            full_runs, touch_runs = full_write_runs(trainer, tmp / "layout", tmp / "full")
            full_s, touch_s = min(full_runs), min(touch_runs)
            status("decoding one version in memory")
            decode_s = codec_decode_s(client, k + config.steady, base, 1)
            decode_threads_s = codec_decode_s(client, k + config.steady, base, APPLY_THREADS)
            del base
            manifests = [client.manifest(RUN, v) for v in range(1, 1 + k)]
            keyframe_bytes = client.plan(RUN, None, 0).total_bytes

            status("bootstrapping new nodes")
            fresh = node(client, tmp / "fresh", "fresh")
            bootstrap_keyframe_s = fresh.sync(0).ready_s
            fresh.follower.close()
            fresh = node(client, tmp / "fresh-head", "fresh-head")
            bootstrap_deltas_s = fresh.sync(k + config.steady).ready_s
            fresh.follower.close()

            status(f"a node {k} versions behind catching up by the deltas")
            replaying = node(client, tmp / "replaying", "replaying")
            replaying.sync(0)
            timeline = replaying.sync(k)
            catchup_deltas_s, catchup_deltas_bytes = timeline.ready_s, timeline.fetched
            replaying.follower.close()

            status(f"building the spans ending at version {k}, then at {k + 1}")
            with (
                Follower(client, RUN, tmp / "compact", node_id="compact") as worker,
                SpanBuilder(client, RUN, worker) as builder,
            ):
                started = time.perf_counter()
                compact_head(builder, k)
                compact_s = time.perf_counter() - started
                compact_head(builder, k + 1)
                compact_incremental_s = time.perf_counter() - started - compact_s
                planned = client.plan(RUN, 0, k)

                status(f"a node {k} versions behind catching up")
                # once untimed: a running node has its compiled kernels loaded; the first use in a
                # process loads them from numba's disk cache or compiles them (seconds), which on a
                # fresh machine made this figure 1.17-1.49 s instead of 0.32-0.33 (H200 host)
                warm = node(client, tmp / "warm", "warm")
                warm.sync(0)
                warm.sync(k)
                warm.follower.close()
                behind = node(client, tmp / "behind", "behind")
                behind.sync(0)
                timeline = behind.sync(k)
                catchup_s, catchup_bytes = timeline.ready_s, timeline.fetched
                catchup_cpu_s = timeline.ready_cpu_s

                applies, mirrors, totals = [], [], []
                for v in range(k + 1, k + 1 + config.steady):
                    status(f"steady updates: version {v}")
                    timeline = behind.sync(v)
                    applies.append(timeline.apply_verify_s)
                    mirrors.append(timeline.mirror_s)
                    totals.append(timeline.ready_s)
                behind.follower.close()

                head = k + config.steady
                status(f"the worker's spans and keyframe of head {head}")
                for h in range(k + 2, head + 1):
                    compact_head(builder, h)
                started = time.perf_counter()
                keyframe_head(builder, head)
                keyframe_build_s = time.perf_counter() - started

            status("bootstrapping a new node from the worker's keyframe")
            fresh = node(client, tmp / "fresh-worker", "fresh-worker")
            bootstrap_plan = client.plan(RUN, None, head)
            board_started = board_cpu()
            timeline = fresh.sync(head)
            bootstrap_s, bootstrap_bytes = timeline.ready_s, timeline.fetched
            bootstrap_cpu = {
                "follower": timeline.ready_cpu_s * 1e9 / trainer.nbytes,
                "board": (board_cpu() - board_started) * 1e9 / trainer.nbytes,
            }
            fresh.follower.close()
        status("measuring the floors: a copy of the view into fresh memory, a loopback read")
        floor = floors(trainer.nbytes)

    apply_s = statistics.median(applies)
    changed = statistics.median(r.changed_elements / r.total_elements for r in results[1:])
    return {
        "view_gb": trainer.nbytes / 1e9,
        "changed_fraction": changed,
        "apply_verify_s": apply_s,
        "codec_decode_s": decode_s,
        "codec_decode_threads_s": decode_threads_s,
        "apply_threads": APPLY_THREADS,
        "mirror_s": statistics.median(mirrors),
        "update_ready_s": statistics.median(totals),
        "full_write_s": full_s,
        "full_write_runs_s": full_runs,
        "page_touch_runs_s": touch_runs,
        "apply_verify_ratio": apply_s / full_s,
        "page_touch_s": touch_s,
        "page_touch_ratio": touch_s / full_s,
        "bootstrap_s": bootstrap_s,
        "bootstrap_bytes": bootstrap_bytes,
        "bootstrap_strategy": bootstrap_plan.strategy,
        "bootstrap_cpu_per_gb": bootstrap_cpu,
        "floor_cpu_per_gb": floor,
        "bootstrap_deltas_s": bootstrap_deltas_s,
        "keyframe_build_s": keyframe_build_s,
        "bootstrap_keyframe_s": bootstrap_keyframe_s,
        "catchup_k": k,
        "catchup_s": catchup_s,
        "catchup_cpu_s": catchup_cpu_s,
        "ranged_threads": RANGED_THREADS,
        "catchup_bytes": catchup_bytes,
        "catchup_strategy": planned.strategy,
        "catchup_deltas_s": catchup_deltas_s,
        "catchup_deltas_bytes": catchup_deltas_bytes,
        "span_bytes": sum(b.size for s in planned.steps if s.kind == "span" for b in s.blobs),
        "compact_s": compact_s,
        "compact_incremental_s": compact_incremental_s,
        "compact_threads": os.cpu_count() or 1,
        "keyframe_bytes": keyframe_bytes,
        "replay_bytes": sum(m.stats.encoded_bytes for m in manifests),
        "targets": {
            "apply_verify_le_0.1x_full_write": apply_s <= 0.1 * full_s,
            "catchup_le_one_keyframe": catchup_bytes <= keyframe_bytes,
            "catchup_le_0.4x_replay": catchup_bytes <= 0.4 * catchup_deltas_bytes,
            "bootstrap_le_2s_per_gb": bootstrap_s <= 2.0 * trainer.nbytes / 1e9,
        },
        "pages_touched": trainer.pages_touched,
        "trajectory_changed_fraction": stats.fraction,
        "view": (
            "synthetic, N(0, 0.02) bf16 weights changed with the per-exponent rates and ULP steps "
            f"of a recorded AdamW trajectory ({stats.source})"
        ),
    }


def render(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"bench follow: {report['view_gb']:.3f} GB bf16 view ({report['view']})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("changed fraction per version", f"{report['changed_fraction']:.4%}"),
        ("  4 KiB pages touched per version", f"{report['pages_touched']:.1%}"),
        (
            "full checkpoint write (fastest; runs)",
            f"{report['full_write_s']:.3f} s; " + ", ".join(f"{t:.2f}" for t in report["full_write_runs_s"]),
        ),
        (
            "apply + verify per version",
            f"{report['apply_verify_s']:.3f} s ({report['apply_verify_ratio']:.3f}x)",
        ),
        (
            "  floor: one write into every page of the shards",
            f"{report['page_touch_s']:.3f} s ({report['page_touch_ratio']:.3f}x)",
        ),
        ("  the codec's decode alone (1 thread, in memory)", f"{report['codec_decode_s']:.3f} s"),
        (
            f"  the codec's decode alone ({report['apply_threads']} threads, as the follower)",
            f"{report['codec_decode_threads_s']:.3f} s",
        ),
        ("mirror into the other slot (after the swap)", f"{report['mirror_s']:.3f} s"),
        ("update ready, download included", f"{report['update_ready_s']:.3f} s"),
        (
            "new node serving head (worker keyframe, ranged)",
            f"{report['bootstrap_s']:.3f} s, {report['bootstrap_bytes']:,} bytes "
            f"({report['bootstrap_strategy']})",
        ),
        (
            "  CPU per GB of view to serving: node, board",
            "{follower:.2f} s, {board:.2f} s".format(**report["bootstrap_cpu_per_gb"]),
        ),
        (
            "  floors per GB: copy into fresh memory, loopback read",
            "{memcpy_fresh:.2f} s, {loopback_read:.2f} s".format(**report["floor_cpu_per_gb"]),
        ),
        ("  before the worker (trainer keyframe + all deltas)", f"{report['bootstrap_deltas_s']:.3f} s"),
        ("  building the worker's keyframe", f"{report['keyframe_build_s']:.3f} s"),
        ("new node serving a keyframe version", f"{report['bootstrap_keyframe_s']:.3f} s"),
        (
            f"catch-up from {report['catchup_k']} behind ({report['ranged_threads']} threads)",
            f"{report['catchup_s']:.3f} s, {report['catchup_cpu_s']:.2f} CPU-s",
        ),
        ("  bytes fetched", f"{report['catchup_bytes']:,} ({report['catchup_strategy']})"),
        ("  of which spans", f"{report['span_bytes']:,}"),
        (
            "  by the deltas alone",
            f"{report['catchup_deltas_s']:.3f} s, {report['catchup_deltas_bytes']:,} bytes",
        ),
        (f"  building the spans ending at {report['catchup_k']}", f"{report['compact_s']:.3f} s"),
        (
            f"  then those ending at {report['catchup_k'] + 1} ({report['compact_threads']} threads)",
            f"{report['compact_incremental_s']:.3f} s",
        ),
        ("  one keyframe", f"{report['keyframe_bytes']:,}"),
        (f"  replaying {report['catchup_k']} deltas", f"{report['replay_bytes']:,}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for name, ok in report["targets"].items():
        table.add_row(f"target {name}", "[green]met[/]" if ok else "[red]missed[/]")
    console.print(table)
