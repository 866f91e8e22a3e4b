"""`deltaboard bench board --mixed`: the board's promises while downloads run beside them.

One board process (local store, embedded index, as `bench board`) carries at once:

- N long-pollers, each re-polling with `after=` the head it was last answered; a wake's
  latency is the first byte of a poller's answer minus the moment the commit's own answer
  arrived (both on the system's monotonic clock, shared by the processes);
- one small commit per second (its latency: request sent to answer received), from a
  process of its own;
- D blob downloaders in a third process (a thread each, raw sockets spliced into
  /dev/null: `Sink`), each fetching one large blob again and again, at a lower CPU
  priority than the board (`DOWNLOADERS_NICE`: they stand for other hosts).

The load generator shares the machine's cores with the board, so it is kept light and
apart: the pollers are protocol callbacks on uvloop (no task or stream per poller; an
answer's arrival is stamped as the loop hands its bytes over), and the commits have their
own process, so that a thousand answers arriving at once delay neither the commit's answer
nor its timestamp. Errors: any answer other than a 200 (a 201 for commits), a dropped
connection, or a download of the wrong size.

Each process reports its CPU seconds over the measured phase (the board's with its
children's, the pollers', the committer's, the downloaders'), with the machine's load
average at both ends, so that a run on a shared machine says who had the cores; the
board's own time per commit (mean, p50 and p99 of its version records' `commit_s`), the
part of a commit's latency spent in the store rather than queued on the way in and out;
and how late the pollers' own loop ran (`LoopLag`), a lower bound of the measuring side's
part of the wake figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import multiprocessing
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
from rich.console import Console

from deltaboard.services.bench.board_bench import (
    AUTH,
    CONNECT_BATCH,
    HOST,
    RUN,
    Publisher,
    board_process,
    get_request,
    percentile,
    raise_fd_limit,
    upload_random_blob,
    waiting_polls,
)

T = TypeVar("T")

POLL_WAIT_S = 30
START_TIMEOUT_S = 120
SLOWEST = 3
LAST_WAKES_S = 60
PIPE_BYTES = 1 << 20
LAG_TICK_S = 0.01
DOWNLOADERS_NICE = 10


@dataclass(frozen=True)
class MixedConfig:
    pollers: int
    downloaders: int
    seconds: float
    blob_mb: int

    @classmethod
    def of(cls, quick: bool, pollers: int, downloaders: int) -> MixedConfig:
        if quick:
            return cls(pollers=pollers, downloaders=downloaders, seconds=15.0, blob_mb=32)
        return cls(pollers=pollers, downloaders=downloaders, seconds=60.0, blob_mb=64)


@dataclass
class Tally:
    """What the pollers saw: (version, arrival) of each wake, and errors."""

    wakes: list[tuple[int, float]]
    errors: int = 0
    stopping: bool = False


class Poller(asyncio.Protocol):
    """One long-poller on its own connection, each answer's head its next `after`."""

    def __init__(self, after: int, tally: Tally) -> None:
        self.after = after
        self.tally = tally
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.arrived = 0.0
        self.refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.ask()

    def ask(self) -> None:
        assert self.transport is not None
        self.transport.write(get_request(f"/v1/runs/{RUN}/head?after={self.after}&wait={POLL_WAIT_S}"))

    def data_received(self, data: bytes) -> None:
        if not self.buffer:
            self.arrived = time.monotonic()
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = bytes(self.buffer[:head_end]).lower()
        length = (
            int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            if b"content-length:" in head
            else 0
        )
        if len(self.buffer) < head_end + 4 + length:
            return
        body = bytes(self.buffer[head_end + 4 : head_end + 4 + length])
        self.buffer.clear()
        if not head.startswith(b"http/1.1 200"):
            self.failed()
            return
        version = json.loads(body)["version"]
        if version is not None and version > self.after:
            self.tally.wakes.append((version, self.arrived))
            self.after = version
        if not self.tally.stopping:
            self.ask()

    def failed(self) -> None:
        self.tally.errors += 1
        self.refused = True
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not (self.tally.stopping or self.refused):
            self.tally.errors += 1


class LoopLag:
    """How late the pollers' loop runs a timer due every `LAG_TICK_S`: the longest stretch
    it spends on one batch of reads. A wake's arrival is stamped when the loop hands its
    bytes over, and a thousand answers landing at once are read one after another, in
    several such batches, by one process that gets a fraction of a core on a loaded
    machine: the wait of the last ones is the measuring side's, and this lag is a lower
    bound of it (the whole wait is only seen with the board's write times beside it)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.due = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.due = time.monotonic() + LAG_TICK_S
        self.timer = asyncio.get_running_loop().call_later(LAG_TICK_S, self.tick)

    def tick(self) -> None:
        now = time.monotonic()
        self.lags.append(max(0.0, now - self.due))  # a timer may fire a little early: no lag
        self.due = now + LAG_TICK_S
        self.timer = asyncio.get_running_loop().call_later(LAG_TICK_S, self.tick)

    def stop(self) -> list[float]:
        if self.timer is not None:
            self.timer.cancel()
        return self.lags or [float("nan")]


class Sink:
    """Where a downloader's bytes go: spliced from the socket through a pipe into /dev/null,
    so that the kernel passes page references and nothing copies the bytes. The downloaders
    stand for hosts of their own, whose copies the board's cores never pay; on one machine
    a copy per byte read took as much CPU as the board itself."""

    def __init__(self) -> None:
        self.out, self.into = os.pipe()
        fcntl.fcntl(self.into, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.null = os.open(os.devnull, os.O_WRONLY)

    def take(self, sock: int, most: int) -> int:
        """Up to `most` bytes from the socket into /dev/null (0: the board closed it)."""
        got = os.splice(sock, self.into, min(most, PIPE_BYTES))
        left = got
        while left:
            left -= os.splice(self.out, self.null, left)
        return got

    def close(self) -> None:
        for fd in (self.out, self.into, self.null):
            os.close(fd)


def download(port: int, sha: str, size: int, sink: Sink) -> int:
    """One whole-blob GET over a raw socket, the body discarded (`Sink`); returns the
    body bytes received."""
    with socket.create_connection((HOST, port), timeout=60) as sock:
        sock.sendall(get_request(f"/v1/runs/{RUN}/blobs/{sha}"))
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                return 0
            head += chunk
        head, _, got_bytes = head.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return 0
        got = len(got_bytes)
        sock.settimeout(None)  # a blocking descriptor for splice, bounded by SO_RCVTIMEO
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 60, 0))
        while got < size:
            n = sink.take(sock.fileno(), size - got)
            if n == 0:
                break
            got += n
        return got


def download_loop(
    port: int, sha: str, size: int, downloaders: int, seconds: float, start: Any, out: Any
) -> None:
    """The downloaders' process: `downloaders` threads fetching the blob again and again for
    `seconds` from the `start` barrier on; puts (bytes, downloads, errors, CPU seconds) on
    the queue `out`. It runs `DOWNLOADERS_NICE` below the board's CPU priority: it stands
    for hosts of their own, and at the board's priority its sixteen threads, always ready
    to receive, queued the board's own threads behind them for the cores."""
    os.nice(DOWNLOADERS_NICE)
    start.wait(START_TIMEOUT_S)
    deadline, cpu = time.monotonic() + seconds, time.process_time()
    totals = [0, 0, 0]
    lock = threading.Lock()

    def one() -> None:
        sink = Sink()
        while time.monotonic() < deadline:
            try:
                got = download(port, sha, size, sink)
            except OSError:
                got = -1
            with lock:
                totals[0] += max(got, 0)
                totals[1 if got == size else 2] += 1
        sink.close()

    threads = [threading.Thread(target=one) for _ in range(downloaders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((totals[0], totals[1], totals[2], time.process_time() - cpu))


def board_pid() -> int:
    """The board child process of this bench (`board_process`)."""
    import psutil

    for child in psutil.Process().children():
        if "deltaboard.board.server.api" in child.cmdline():
            return int(child.pid)
    raise RuntimeError("the board process is not a child of this bench")


def cpu_seconds(pid: int) -> float:
    """CPU seconds of the process and of its children now (the board's download sender)."""
    import psutil

    process = psutil.Process(pid)
    total = 0.0
    for each in (process, *process.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = each.cpu_times()
            total += times.user + times.system
    return total


async def commit_seconds(http: httpx.AsyncClient, versions: set[int]) -> dict[int, float]:
    """The board's own time for each of `versions`' commits (the `commit_s` of its version
    records: from the commit's entry into `BoardService.commit` until the store took it)."""
    answer = await http.get(f"/v1/runs/{RUN}/versions", params={"limit": len(versions) + 1})
    answer.raise_for_status()
    return {
        v["version"]: v["commit_s"]
        for v in answer.json()
        if v["version"] in versions and v["commit_s"] is not None
    }


def disk_sync_seconds(directory: Path) -> float:
    """One fsync of a small new file in `directory` (the board's filesystem): what one round
    of a commit's syncs costs on this disk now, a floor the commit cannot go below."""
    fd, name = tempfile.mkstemp(dir=directory)
    try:
        os.write(fd, b"x" * 512)
        began = time.monotonic()
        os.fsync(fd)
        return time.monotonic() - began
    finally:
        os.close(fd)
        os.unlink(name)


@dataclass
class Committed:
    """What the committer saw: (version, latency, answer time) of each commit, errors, a
    disk sync timed after each commit (`disk_sync_seconds`), and its CPU seconds."""

    done: list[tuple[int, float, float]]
    errors: int
    syncs: list[float]
    cpu_s: float = 0.0


async def commits(
    url: str, version: int, epoch: int, seconds: float, directory: Path, start: Any
) -> Committed:
    """A commit per second for `seconds` from the `start` barrier on, each followed by a
    disk sync in `directory`. The client is warmed first (its connection made, its lazy
    imports done), as a trainer's is: a first request cost up to 0.3 s in a fresh process."""
    committed = Committed(done=[], errors=0, syncs=[])
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
        publisher = Publisher(http)
        publisher.version, publisher.epoch = version, epoch
        (await http.get(f"/v1/runs/{RUN}/head")).raise_for_status()
        await asyncio.to_thread(start.wait, START_TIMEOUT_S)
        began, cpu = time.monotonic(), time.process_time()
        for i in range(int(seconds)):
            await asyncio.sleep(max(0.0, began + i + 1 - time.monotonic()))
            try:
                latency = await publisher.commit()
            except httpx.HTTPError:
                committed.errors += 1
                continue
            committed.done.append((publisher.version, latency, time.monotonic()))
            committed.syncs.append(disk_sync_seconds(directory))
    committed.cpu_s = time.process_time() - cpu
    return committed


def commit_loop(
    url: str, version: int, epoch: int, seconds: float, directory: Path, start: Any, out: Any
) -> None:
    """The committer's process: puts `commits`' answer on the queue `out`."""
    out.put(asyncio.run(commits(url, version, epoch, seconds, directory, start)))


async def connect_pollers(port: int, count: int, after: int, tally: Tally) -> list[asyncio.Transport]:
    loop = asyncio.get_running_loop()
    transports: list[asyncio.Transport] = []
    for start in range(0, count, CONNECT_BATCH):
        batch = min(CONNECT_BATCH, count - start)
        for _ in range(batch):
            transport, _ = await loop.create_connection(lambda: Poller(after, tally), HOST, port)
            transports.append(transport)
        await asyncio.sleep(0.05)
    return transports


async def last_wakes(transports: list[asyncio.Transport], version: int | None) -> None:
    """Until every poller has been answered `version` (the last commit's), or for at most
    `LAST_WAKES_S` (a poller that stopped on an error never will)."""
    pollers = [cast(Poller, transport.get_protocol()) for transport in transports]
    deadline = time.monotonic() + LAST_WAKES_S
    while version is not None and time.monotonic() < deadline:
        if all(poller.after >= version or poller.refused for poller in pollers):
            return
        await asyncio.sleep(0.05)


async def measure_mixed(url: str, config: MixedConfig, tmp: Path, console: Console) -> dict[str, Any]:
    port = int(url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
        publisher = Publisher(http)
        await publisher.setup()
        sha, size = await asyncio.to_thread(upload_random_blob, url, config.blob_mb, tmp)
        tally = Tally(wakes=[])
        transports = await connect_pollers(port, config.pollers, publisher.version, tally)
        deadline = time.monotonic() + 60
        while await waiting_polls(http) < config.pollers:
            if time.monotonic() > deadline:
                raise TimeoutError("the pollers never all reached the board")
            await asyncio.sleep(0.05)
        console.print(
            f"  {config.pollers} long-pollers, {config.downloaders} downloaders of {config.blob_mb} MiB, "
            f"a commit per second for {config.seconds:g}s"
        )
        board = board_pid()
        context = multiprocessing.get_context("spawn")
        # Both processes start their work together once started and imported: a second of
        # imports in each is no part of the board's load.
        start = context.Barrier(3)
        down_queue, commit_queue = context.Queue(), context.Queue()
        processes = [
            context.Process(
                target=download_loop,
                args=(port, sha, size, config.downloaders, config.seconds, start, down_queue),
            ),
            context.Process(
                target=commit_loop,
                args=(url, publisher.version, publisher.epoch, config.seconds, tmp, start, commit_queue),
            ),
        ]
        for process in processes:
            process.start()
        await asyncio.to_thread(start.wait, START_TIMEOUT_S)
        board_cpu, own_cpu, load_start = cpu_seconds(board), time.process_time(), os.getloadavg()[0]
        began = time.monotonic()
        lag = LoopLag()
        lag.start()
        down_bytes, down_count, down_errors, down_cpu = await asyncio.to_thread(down_queue.get)
        committed = await asyncio.to_thread(commit_queue.get)
        done = committed.done
        for process in processes:
            await asyncio.to_thread(process.join)
        await last_wakes(transports, max((version for version, _, _ in done), default=None))
        tally.stopping = True
        lags = lag.stop()
        board_cpu, own_cpu = cpu_seconds(board) - board_cpu, time.process_time() - own_cpu
        own = await commit_seconds(http, {version for version, _, _ in done})
        for transport in transports:
            transport.close()
    elapsed = time.monotonic() - began
    acked = {version: answered for version, _, answered in done}
    wakes = [arrived - acked[version] for version, arrived in tally.wakes if version in acked] or [
        float("nan")
    ]
    latencies = [latency for _, latency, _ in done] or [float("nan")]
    syncs = committed.syncs or [float("nan")]
    in_board = list(own.values()) or [float("nan")]
    slowest = sorted(done, key=lambda commit: commit[1])[-SLOWEST:]
    return {
        "mixed_pollers": config.pollers,
        "mixed_downloaders": config.downloaders,
        "mixed_downloaders_nice": DOWNLOADERS_NICE,
        "mixed_seconds": config.seconds,
        "mixed_commits": len(done),
        "mixed_wakes": len(wakes),
        "mixed_wake_p50_ms": round(percentile(wakes, 50) * 1e3, 2),
        "mixed_wake_p99_ms": round(percentile(wakes, 99) * 1e3, 2),
        # The pollers' own delay in stamping arrivals, a lower bound (`LoopLag`)
        "mixed_poller_lag_p50_ms": round(percentile(lags, 50) * 1e3, 2),
        "mixed_poller_lag_p99_ms": round(percentile(lags, 99) * 1e3, 2),
        "mixed_commit_p50_ms": round(percentile(latencies, 50) * 1e3, 2),
        "mixed_commit_p99_ms": round(percentile(latencies, 99) * 1e3, 2),
        "mixed_download_gbps": round(down_bytes / elapsed / 1e9, 3),
        "mixed_downloads": down_count,
        "mixed_errors": tally.errors + committed.errors + down_errors,
        "mixed_commit_in_board_mean_ms": round(sum(in_board) / len(in_board) * 1e3, 2),
        "mixed_commit_in_board_p50_ms": round(percentile(in_board, 50) * 1e3, 2),
        "mixed_commit_in_board_p99_ms": round(percentile(in_board, 99) * 1e3, 2),
        # [version, latency, the board's own time] of the slowest commits: where their time went
        "mixed_commit_slowest_ms": [
            [version, round(latency * 1e3, 1), round(own.get(version, float("nan")) * 1e3, 1)]
            for version, latency, _ in reversed(slowest)
        ],
        "mixed_disk_sync_p50_ms": round(percentile(syncs, 50) * 1e3, 2),
        "mixed_disk_sync_p99_ms": round(percentile(syncs, 99) * 1e3, 2),
        "mixed_cpu_board_s": round(board_cpu, 2),
        "mixed_cpu_pollers_s": round(own_cpu, 2),
        "mixed_cpu_committer_s": round(committed.cpu_s, 2),
        "mixed_cpu_downloaders_s": round(down_cpu, 2),
        "mixed_load_start": round(load_start, 2),
        "mixed_load_end": round(os.getloadavg()[0], 2),
    }


def run_on_uvloop(main: Coroutine[Any, Any, T]) -> T:
    """The pollers on uvloop where it is installed (with the board extra): less of the
    machine's CPU for the measuring side."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run_mixed_bench(quick: bool, pollers: int, downloaders: int, json_path: Path | None) -> dict[str, Any]:
    console = Console()
    config = MixedConfig.of(quick, pollers, downloaders)
    raise_fd_limit(2 * pollers + 4 * downloaders + 256)
    with (
        tempfile.TemporaryDirectory(prefix="deltaboard-bench-") as tmp,
        board_process(Path(tmp) / "board") as url,
    ):
        console.print(f"[bold]bench board --mixed[/] against {url} (another process, local store)")
        results = run_on_uvloop(measure_mixed(url, config, Path(tmp), console))
    results.update({"quick": quick, "blob_mb": config.blob_mb})
    for key, value in results.items():
        console.print(f"  {key:>20}: {value}")
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2) + "\n")
    return results
