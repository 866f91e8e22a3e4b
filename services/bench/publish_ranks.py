"""`deltaboard bench publish --ranks N`: a sharded trainer's ranks publish their own slices.

N processes (gloo on CPU, `torch.distributed`) each hold a row slice of every fp32 master
tensor, as FSDP2's `Shard(0)` leaves them (rows not divisible by N: uneven shards), and
publish it through `TorchDistributedRanks(slices=...)` with its declared place; one more
process holds every tensor whole and publishes the same bf16 view alone. Both publish one
keyframe and then `deltas` deltas to their own run on one board.

The masters are a pure function of each element's global position and the version (an
integer hash, computed by each rank on its own rows only), so the N ranks' slices put
together are exactly the one rank's tensors, and no rank ever builds a whole tensor. Each
version's step moves every element by `lr` in a hashed direction: an Adam-sized step, which
changes about 1% of the bf16 view per version, as the recorded trajectories do at lr 1e-6.

Per rank (medians over the deltas): `blocked_ms`, the trainer's time inside `publish()`;
`e2e_s`, from the call to the commit; `sent_bytes`, the blob bytes the rank uploaded per
version; `peak_extra_bytes`, the process's resident memory at its highest while publishing
(sampled every 5 ms) above what it held before its `Publisher` existed, beside its shard's
view (`shard_view_bytes`) and the publisher's documented bound (`memory_bound_bytes`:
view buffers plus host blob buffers). Per run: `board_bytes`, what the board stores per
delta (blobs and manifest). The issue's targets: blocked time with 4 ranks at most 0.35x
the one rank's; board bytes within 2% of the one rank's; peak extra memory within the
shard's view plus the documented buffers.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console
from rich.table import Table

from deltaboard.services.bench.publish_bench import board_process

if TYPE_CHECKING:
    import torch

COLS = 1024
CHUNK_ROWS = 256  # rows hashed at once: keeps the state update's temporaries small
BLOCKED_TARGET_4 = 0.35
BYTES_TARGET = 0.02


@dataclass(frozen=True)
class RanksConfig:
    ranks: int = 4
    view_mb: float = 256.0  # the bf16 view of the whole state, in MB
    tensors: int = 8
    deltas: int = 4
    lr: float = 1e-6
    threads: int = 1  # torch threads per process: each rank stands for one accelerator


QUICK_RANKS = RanksConfig(ranks=2, view_mb=16.0, tensors=4, deltas=2)


def _rows(config: RanksConfig) -> int:
    """Rows per tensor: the view's size over the tensors, made odd so no world divides it."""
    rows = max(3, int(config.view_mb * 1e6 / (2 * COLS * config.tensors)))
    return rows | 1


def _hashed(index: torch.Tensor, salt: int) -> torch.Tensor:
    """A uniform value in [0, 1) per int64 index (a multiply-xorshift hash of index and salt)."""
    import torch

    x = (index * 2654435761 + salt * 40503) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return x.to(torch.float32) / 2.0**32


def _master(tensor: int, rows: range) -> torch.Tensor:
    """Version 0 of master `tensor`'s `rows`: values in (-0.1, 0.1)."""
    import torch

    out = torch.empty(len(rows), COLS, dtype=torch.float32)
    for start in range(0, len(rows), CHUNK_ROWS):
        stop = min(len(rows), start + CHUNK_ROWS)
        index = _arange(rows.start + start, rows.start + stop)
        out[start:stop] = ((_hashed(index, tensor) - 0.5) * 0.2).view(stop - start, COLS)
    return out


def _step(weight: torch.Tensor, tensor: int, rows: range, version: int, lr: float) -> None:
    """The optimizer step before `version`: every element moves by `lr`, up or down."""
    for start in range(0, len(rows), CHUNK_ROWS):
        stop = min(len(rows), start + CHUNK_ROWS)
        index = _arange(rows.start + start, rows.start + stop)
        up = _hashed(index, 1_000_003 * version + tensor) < 0.5
        weight[start:stop] += (up.to(weight.dtype) * 2 - 1).view(stop - start, COLS) * lr


def _arange(row0: int, row1: int) -> torch.Tensor:
    import torch

    return torch.arange(row0 * COLS, row1 * COLS, dtype=torch.int64)


def _rss() -> int:
    """This process's resident bytes now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The highest resident memory seen while running, sampled every 5 ms on a thread."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, _rss())


def rank_main(
    rank: int, world: int, init_file: str, url: str, token: str, config: RanksConfig, out: str
) -> None:
    """One trainer process: rank `rank` of `world` (world 1: the lone, unsharded publisher)."""
    import torch
    import torch.distributed as dist

    from deltaboard.clients.board_client import BoardClient
    from deltaboard.publisher.distributed import TorchDistributedRanks
    from deltaboard.publisher.publisher import Publisher

    torch.set_num_threads(config.threads)
    rows = _rows(config)
    mine = range(rows * rank // world, rows * (rank + 1) // world)
    state = {f"layers.{i}.weight": _master(i, mine) for i in range(config.tensors)}
    ranks = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        declared = {name: ((rows, COLS), (mine.start, 0)) for name in state}
        ranks = TorchDistributedRanks(slices=declared)
    before = _rss()
    peak = PeakRss()
    results = []
    with (
        BoardClient(url, token) as client,
        Publisher(client, f"ranks-{world}", ranks=ranks, assets={}, lease_ttl_s=300) as publisher,
    ):
        for version in range(config.deltas + 1):
            if version:
                for i, weight in enumerate(state.values()):
                    _step(weight, i, mine, version, config.lr)
            results.append(publisher.publish(state, step=version).result())
        bound = publisher.memory_bound_bytes  # its view buffers exist once it has published
    peak_bytes = peak.stop()
    if world > 1:
        dist.destroy_process_group()
    deltas = [r for r in results if r.kind == "delta"]
    figures = {
        "rank": rank,
        "shard_view_bytes": len(mine) * COLS * 2 * config.tensors,
        "blocked_ms": 1e3 * statistics.median(r.blocked_s for r in deltas),
        "e2e_s": statistics.median(r.e2e_s for r in deltas),
        "sent_bytes": int(statistics.median(r.encoded_bytes for r in deltas)),
        "changed_fraction": statistics.median(r.changed_elements / max(1, r.total_elements) for r in deltas),
        "peak_extra_bytes": peak_bytes - before,
        "memory_bound_bytes": bound,
    }
    Path(out, f"rank-{world}-{rank}.json").write_text(json.dumps(figures))


def process_main(
    index: int, world: int, init_file: str, url: str, token: str, config: RanksConfig, out: str
) -> None:
    """Process `index` of `world + 1` started together (one start-up wave: importing torch
    takes many seconds on a busy machine): the last publishes alone first, then the others
    publish as the `world` ranks, so the two runs never share the cores."""
    done = Path(out, "one-rank.done")
    if index == world:
        rank_main(0, 1, init_file, url, token, config, out)
        done.touch()
        return
    while not done.exists():
        time.sleep(0.05)
    rank_main(index, world, init_file, url, token, config, out)


def _spawn(
    url: str, token: str, config: RanksConfig, tmp: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The one rank's figures and the `config.ranks` ranks'."""
    import multiprocessing

    from torch.multiprocessing.spawn import start_processes

    # Each process forks from a server that imported torch and the publisher once: three
    # processes importing torch at once take a minute on two busy cores.
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "deltaboard.publisher.distributed", __name__]
    )
    world = config.ranks
    start_processes(  # type: ignore[no-untyped-call]
        process_main,
        args=(world, str(tmp / "init"), url, token, config, str(tmp)),
        nprocs=world + 1,
        join=True,
        start_method="forkserver",
    )

    def figures(world: int, rank: int) -> dict[str, Any]:
        return dict(json.loads((tmp / f"rank-{world}-{rank}.json").read_text()))

    return figures(1, 0), [figures(world, r) for r in range(world)]


def _board_bytes(url: str, token: str, run: str) -> int:
    """Median bytes the board stores per delta of `run` (blobs and manifest)."""
    answer = httpx.get(f"{url}/v1/runs/{run}/versions", headers={"Authorization": f"Bearer {token}"})
    answer.raise_for_status()
    return int(statistics.median(v["bytes"] for v in answer.json() if v["kind"] == "delta"))


def run_ranks(config: RanksConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Publish the same versions with `config.ranks` ranks and with one; see the module doc."""
    with (
        tempfile.TemporaryDirectory(prefix="deltaboard-ranks-") as tmp,
        board_process(Path(tmp)) as (url, token),
    ):
        progress(
            f"one rank publishes the whole {config.view_mb:g} MB view, then {config.ranks} ranks their slices"
        )
        one, sharded = _spawn(url, token, config, Path(tmp))
        one_bytes = _board_bytes(url, token, "ranks-1")
        sharded_bytes = _board_bytes(url, token, f"ranks-{config.ranks}")
    blocked = max(r["blocked_ms"] for r in sharded) / one["blocked_ms"]
    return {
        "config": asdict(config),
        "one_rank": one,
        "ranks": sharded,
        "board_bytes_one": one_bytes,
        "board_bytes_sharded": sharded_bytes,
        "blocked_ratio": blocked,
        "sent_ratio": sum(r["sent_bytes"] for r in sharded) / max(1, one["sent_bytes"]),
        "board_bytes_ratio": sharded_bytes / max(1, one_bytes),
        "memory_within_bound": all(
            r["peak_extra_bytes"] <= r["shard_view_bytes"] + r["memory_bound_bytes"] for r in sharded
        ),
    }


def render_ranks(report: dict[str, Any], console: Console) -> None:
    """Per-rank figures, the one rank's, and the issue's targets."""
    config = report["config"]
    table = Table(
        title=f"publish: {config['view_mb']:g} MB bf16 view, {config['ranks']} ranks vs one (gloo, CPU)"
    )
    for col in (
        "rank",
        "shard MB",
        "blocked ms",
        "e2e s",
        "sent B/version",
        "changed",
        "peak extra MB",
        "bound MB",
    ):
        table.add_column(col, justify="right")
    for who, r in [("one", report["one_rank"])] + [(str(r["rank"]), r) for r in report["ranks"]]:
        table.add_row(
            who,
            f"{r['shard_view_bytes'] / 1e6:.1f}",
            f"{r['blocked_ms']:.1f}",
            f"{r['e2e_s']:.3f}",
            f"{r['sent_bytes']:,}",
            f"{r['changed_fraction']:.2%}",
            f"{r['peak_extra_bytes'] / 1e6:.1f}",
            f"{r['memory_bound_bytes'] / 1e6:.0f}",
        )
    console.print(table)

    def verdict(ok: bool) -> str:
        return "[green]met[/green]" if ok else "[red]missed[/red]"

    ratio, n = report["blocked_ratio"], config["ranks"]
    line = f"slowest rank's blocked time: {ratio:.3f}x the one rank's"
    console.print(
        line
        + (
            f" (target with 4 ranks <= {BLOCKED_TARGET_4}) {verdict(ratio <= BLOCKED_TARGET_4)}"
            if n == 4
            else ""
        )
    )
    drift = report["board_bytes_ratio"] - 1
    console.print(
        f"board bytes per delta: {report['board_bytes_sharded']:,} vs {report['board_bytes_one']:,} "
        f"({drift:+.2%}; target within {BYTES_TARGET:.0%}) {verdict(abs(drift) <= BYTES_TARGET)}"
    )
    console.print(f"bytes sent by all ranks: {report['sent_ratio']:.3f}x the one rank's")
    console.print(
        "peak extra memory within the shard's view plus the documented buffers: "
        + verdict(report["memory_within_bound"])
    )
