"""`deltaboard bench board --mixed`: the board's promises while downloads run beside them.

One board process (local store, embedded index, as `bench board`) carries at once:

- N long-pollers (raw asyncio connections, as in `bench board`), each re-polling with
  `after=` the head it was last answered; a wake's latency is the first byte of a
  poller's answer minus the moment the commit's own answer arrived;
- D blob downloaders in another process (a thread each, raw sockets read with
  `recv_into`, so that the measuring side stays cheap), each fetching one large blob
  again and again, bytes discarded;
- one small commit per second (its latency: request sent to answer received).

Errors: any answer other than a 200 (a 201 for commits), a dropped connection, or a
download of the wrong size. The pollers and the publisher share this process; the
downloaders have their own, so that reading blobs does not delay the measuring side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    read_response,
    upload_random_blob,
    waiting_polls,
)

POLL_WAIT_S = 30
DOWNLOAD_BUFFER = 1 << 20


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
    """What the pollers saw: wake latencies (s) and errors."""

    wakes: list[float]
    errors: int = 0


async def poller(port: int, after: int, acked: dict[int, float], tally: Tally, stop: asyncio.Event) -> None:
    """Long-poll the head for ever, one connection, each answer's version the next `after`."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        while not stop.is_set():
            writer.write(get_request(f"/v1/runs/{RUN}/head?after={after}&wait={POLL_WAIT_S}"))
            try:
                arrived, body = await read_response(reader)
            except (RuntimeError, OSError, asyncio.IncompleteReadError):
                if not stop.is_set():
                    tally.errors += 1
                return
            version = json.loads(body)["version"]
            if version is not None and version > after and version in acked:
                tally.wakes.append(arrived - acked[version])
            after = version if version is not None else after
    finally:
        writer.close()


def download(port: int, sha: str, size: int, buffer: bytearray) -> int:
    """One whole-blob GET over a raw socket, the body read into `buffer` (recv_into: the
    measuring side copies once, in the kernel, without holding the GIL); returns the body
    bytes received."""
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
        view = memoryview(buffer)
        while got < size:
            n = sock.recv_into(view)
            if n == 0:
                break
            got += n
        return got


def download_loop(port: int, sha: str, size: int, downloaders: int, seconds: float, out: Any) -> None:
    """The downloaders' process: `downloaders` threads fetching the blob again and again for
    `seconds`; puts (bytes, downloads, errors) on the queue `out`."""
    deadline = time.monotonic() + seconds
    totals = [0, 0, 0]
    lock = threading.Lock()

    def one() -> None:
        buffer = bytearray(DOWNLOAD_BUFFER)
        while time.monotonic() < deadline:
            try:
                got = download(port, sha, size, buffer)
            except OSError:
                got = -1
            with lock:
                totals[0] += max(got, 0)
                totals[1 if got == size else 2] += 1

    threads = [threading.Thread(target=one) for _ in range(downloaders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((totals[0], totals[1], totals[2]))


async def measure_mixed(url: str, config: MixedConfig, tmp: Path, console: Console) -> dict[str, Any]:
    port = int(url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
        publisher = Publisher(http)
        await publisher.setup()
        sha, size = await asyncio.to_thread(upload_random_blob, url, config.blob_mb, tmp)
        acked: dict[int, float] = {}
        tally = Tally(wakes=[])
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        for start in range(0, config.pollers, CONNECT_BATCH):
            batch = min(CONNECT_BATCH, config.pollers - start)
            for _ in range(batch):
                tasks.append(asyncio.create_task(poller(port, publisher.version, acked, tally, stop)))
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 60
        while await waiting_polls(http) < config.pollers:
            if time.monotonic() > deadline:
                raise TimeoutError("the pollers never all reached the board")
            await asyncio.sleep(0.05)
        console.print(
            f"  {config.pollers} long-pollers, {config.downloaders} downloaders of {config.blob_mb} MiB, "
            f"a commit per second for {config.seconds:g}s"
        )
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        downloads = context.Process(
            target=download_loop, args=(port, sha, size, config.downloaders, config.seconds, queue)
        )
        downloads.start()
        commits: list[float] = []
        commit_errors = 0
        began = time.monotonic()
        for i in range(int(config.seconds)):
            await asyncio.sleep(max(0.0, began + i + 1 - time.monotonic()))
            try:
                commits.append(await publisher.commit())
            except httpx.HTTPError:
                commit_errors += 1
                continue
            acked[publisher.version] = time.perf_counter()
        down_bytes, down_count, down_errors = await asyncio.to_thread(queue.get)
        await asyncio.to_thread(downloads.join)
        await asyncio.sleep(1.0)  # the last commit's wakes
        stop.set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    elapsed = time.monotonic() - began
    wakes = tally.wakes or [float("nan")]
    return {
        "mixed_pollers": config.pollers,
        "mixed_downloaders": config.downloaders,
        "mixed_seconds": config.seconds,
        "mixed_commits": len(commits),
        "mixed_wakes": len(tally.wakes),
        "mixed_wake_p50_ms": round(percentile(wakes, 50) * 1e3, 2),
        "mixed_wake_p99_ms": round(percentile(wakes, 99) * 1e3, 2),
        "mixed_commit_p50_ms": round(percentile(commits or [float("nan")], 50) * 1e3, 2),
        "mixed_commit_p99_ms": round(percentile(commits or [float("nan")], 99) * 1e3, 2),
        "mixed_download_gbps": round(down_bytes / elapsed / 1e9, 3),
        "mixed_downloads": down_count,
        "mixed_errors": tally.errors + commit_errors + down_errors,
    }


def run_mixed_bench(quick: bool, pollers: int, downloaders: int, json_path: Path | None) -> dict[str, Any]:
    console = Console()
    config = MixedConfig.of(quick, pollers, downloaders)
    raise_fd_limit(2 * pollers + 4 * downloaders + 256)
    with (
        tempfile.TemporaryDirectory(prefix="deltaboard-bench-") as tmp,
        board_process(Path(tmp) / "board") as url,
    ):
        console.print(f"[bold]bench board --mixed[/] against {url} (another process, local store)")
        results = asyncio.run(measure_mixed(url, config, Path(tmp), console))
    results.update({"quick": quick, "blob_mb": config.blob_mb})
    for key, value in results.items():
        console.print(f"  {key:>20}: {value}")
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2) + "\n")
    return results
