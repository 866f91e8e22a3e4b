"""`deltaboard bench board`: the board's hot paths, measured against a board in another
process on loopback (local store, embedded index: the single-node default).

- wake: N long-pollers wait on `/head?after=v&wait=..`; one commit; latency = first byte
  of each poller's answer minus the moment the commit's own answer arrived. The pollers
  are raw asyncio connections so that the measuring side stays cheap next to the board.
- head_rps: plain `/head` requests per second over keep-alive connections.
- commit: latency of sequential small commits (blobs already uploaded).
- blob_get_gbps: streaming download of one large blob, discarded as it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import resource
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from deltaboard.board.contract.schemas import BlobRef, Manifest, ManifestStats, TensorEntry, ViewSpec

TOKEN = "bench-admin-token"
RUN = "bench"
HOST = "127.0.0.1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEAD_CONNECTIONS = 32
CONNECT_BATCH = 100
CHUNK = 1024 * 1024


@dataclass(frozen=True)
class BenchConfig:
    pollers: int
    wake_rounds: int
    head_seconds: float
    commits: int
    blob_mb: int

    @classmethod
    def of(cls, quick: bool, pollers: int) -> BenchConfig:
        if quick:
            return cls(pollers=pollers, wake_rounds=1, head_seconds=2.0, commits=100, blob_mb=128)
        return cls(pollers=pollers, wake_rounds=3, head_seconds=5.0, commits=500, blob_mb=512)


def raise_fd_limit(wanted: int) -> None:
    """Each poller holds a socket on both sides: lift the soft limit toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@contextlib.contextmanager
def board_process(data_dir: Path) -> Iterator[str]:
    """A board child process (children inherit the raised descriptor limit)."""
    from deltaboard.board.server.api.server import free_port, spawn

    port = free_port()
    env = {
        "DELTABOARD_DATA_DIR": str(data_dir),
        "DELTABOARD_PORT": str(port),
        "DELTABOARD_HOST": HOST,
        "DELTABOARD_TOKENS": f"admin:{TOKEN}",
        "DELTABOARD_LOG_LEVEL": "warning",
    }
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = spawn(env, data_dir / "board.log")
    try:
        yield f"http://{HOST}:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except Exception:
            proc.kill()
            proc.wait()


def small_manifest(version: int, epoch: int, sha: str, size: int) -> Manifest:
    return Manifest(
        run=RUN,
        version=version,
        parent=None if version == 0 else version - 1,
        kind="full" if version == 0 else "delta",
        view=ViewSpec(),
        epoch=epoch,
        created_at=time.time(),
        tensors=(
            TensorEntry(
                name="w",
                dtype="U8",
                shape=(size,),
                file="model.safetensors",
                blob=BlobRef(sha256=sha, offset=0, length=size),
                digest="0" * 32,
                changed=size,
            ),
        ),
        state_digest="0" * 64,  # a sha256, as codec.state_digest gives
        stats=ManifestStats(changed_elements=size, total_elements=size, encoded_bytes=size, view_bytes=size),
    )


class Publisher:
    """Commits one small version after another (the blob is uploaded once)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.version = -1
        self.epoch = 0
        self.payload = b"bench payload" * 64
        self.sha = hashlib.sha256(self.payload).hexdigest()

    async def setup(self) -> None:
        (await self.http.post("/v1/runs", json={"name": RUN})).raise_for_status()
        lease = await self.http.post(f"/v1/runs/{RUN}/lease", json={"holder": "bench", "ttl_s": 3600})
        self.epoch = lease.raise_for_status().json()["epoch"]
        (await self.http.put(f"/v1/runs/{RUN}/blobs/{self.sha}", content=self.payload)).raise_for_status()
        await self.commit()

    async def commit(self) -> float:
        """Commit the next version; returns its latency in seconds."""
        m = small_manifest(self.version + 1, self.epoch, self.sha, len(self.payload))
        body = json.dumps({"manifest": m.model_dump(mode="json")})
        started = time.perf_counter()
        response = await self.http.post(
            f"/v1/runs/{RUN}/commit", content=body, headers={"Content-Type": "application/json"}
        )
        elapsed = time.perf_counter() - started
        response.raise_for_status()
        self.version += 1
        return elapsed


def get_request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()


async def read_response(reader: asyncio.StreamReader) -> tuple[float, bytes]:
    """Read one HTTP/1.1 response; returns when its first byte arrived, and its body."""
    first = await reader.readexactly(1)
    arrived = time.perf_counter()
    head = first + await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected answer: {head[:200]!r}")
    return arrived, await reader.readexactly(length)


async def waiting_polls(http: httpx.AsyncClient) -> int:
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith("deltaboard_long_polls "):
            return int(float(line.split()[1]))
    return 0


async def wake_round(http: httpx.AsyncClient, port: int, publisher: Publisher, pollers: int) -> list[float]:
    """Latencies (seconds) of `pollers` long-polls woken by one commit."""
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for start in range(0, pollers, CONNECT_BATCH):
        batch = min(CONNECT_BATCH, pollers - start)
        conns += await asyncio.gather(*(asyncio.open_connection(HOST, port) for _ in range(batch)))
    request = get_request(f"/v1/runs/{RUN}/head?after={publisher.version}&wait=60")
    for _, writer in conns:
        writer.write(request)
    await asyncio.gather(*(writer.drain() for _, writer in conns))
    tasks = [asyncio.create_task(read_response(reader)) for reader, _ in conns]
    deadline = time.monotonic() + 60
    while await waiting_polls(http) < pollers:
        if time.monotonic() > deadline:
            raise TimeoutError("the pollers never all reached the board")
        await asyncio.sleep(0.05)
    await publisher.commit()
    committed = time.perf_counter()
    arrivals = await asyncio.gather(*tasks)
    for _, writer in conns:
        writer.close()
    return [arrived - committed for arrived, _ in arrivals]


async def head_rps(port: int, seconds: float) -> float:
    request = get_request(f"/v1/runs/{RUN}/head")
    stop = time.perf_counter() + seconds
    counts = [0] * HEAD_CONNECTIONS

    async def loop(i: int) -> None:
        reader, writer = await asyncio.open_connection(HOST, port)
        while time.perf_counter() < stop:
            writer.write(request)
            await read_response(reader)
            counts[i] += 1
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(HEAD_CONNECTIONS)))
    return sum(counts) / (time.perf_counter() - started)


def upload_random_blob(url: str, blob_mb: int, tmp: Path) -> tuple[str, int]:
    """Upload a blob of `blob_mb` MiB of random bytes; returns its sha256 and size."""
    path = tmp / "blob.bin"
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(blob_mb):
            chunk = os.urandom(CHUNK)
            digest.update(chunk)
            f.write(chunk)
    sha = digest.hexdigest()
    size = path.stat().st_size
    with httpx.Client(base_url=url, headers=AUTH, timeout=300) as http, open(path, "rb") as f:
        http.put(
            f"/v1/runs/{RUN}/blobs/{sha}", content=f, headers={"Content-Length": str(size)}
        ).raise_for_status()
    path.unlink()
    return sha, size


def blob_gbps(url: str, blob_mb: int, tmp: Path) -> float:
    """Upload one blob of `blob_mb` MiB, then time streaming it back (best of three)."""
    sha, size = upload_random_blob(url, blob_mb, tmp)
    with httpx.Client(base_url=url, headers=AUTH, timeout=300) as http:
        rates = []
        for _ in range(3):
            started = time.perf_counter()
            got = 0
            with http.stream("GET", f"/v1/runs/{RUN}/blobs/{sha}") as response:
                for chunk in response.iter_raw():  # no re-chunking: that would copy every byte
                    got += len(chunk)
            assert got == size
            rates.append(size / (time.perf_counter() - started) / 1e9)
    return max(rates)


async def measure(url: str, config: BenchConfig, console: Console) -> dict[str, Any]:
    port = int(url.rsplit(":", 1)[1])
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as http:
        publisher = Publisher(http)
        await publisher.setup()
        wakes: list[float] = []
        for i in range(config.wake_rounds):
            console.print(f"  wake round {i + 1}/{config.wake_rounds}: {config.pollers} long-pollers")
            wakes += await wake_round(http, port, publisher, config.pollers)
        console.print(f"  head requests for {config.head_seconds:g}s over {HEAD_CONNECTIONS} connections")
        rps = await head_rps(port, config.head_seconds)
        console.print(f"  {config.commits} sequential commits")
        commits = [await publisher.commit() for _ in range(config.commits)]
    return {
        "pollers": config.pollers,
        "wake_p50_ms": round(percentile(wakes, 50) * 1e3, 2),
        "wake_p99_ms": round(percentile(wakes, 99) * 1e3, 2),
        "wake_max_ms": round(max(wakes) * 1e3, 2),
        "head_rps": round(rps, 1),
        "commit_p50_ms": round(percentile(commits, 50) * 1e3, 2),
        "commit_p99_ms": round(percentile(commits, 99) * 1e3, 2),
    }


def run_board_bench(quick: bool, pollers: int, json_path: Path | None) -> dict[str, Any]:
    console = Console()
    config = BenchConfig.of(quick, pollers)
    raise_fd_limit(2 * pollers + 256)
    with (
        tempfile.TemporaryDirectory(prefix="deltaboard-bench-") as tmp,
        board_process(Path(tmp) / "board") as url,
    ):
        console.print(f"[bold]bench board[/] against {url} (another process, local store, embedded index)")
        results = asyncio.run(measure(url, config, console))
        console.print(f"  blob download of {config.blob_mb} MiB")
        results["blob_get_gbps"] = round(blob_gbps(url, config.blob_mb, Path(tmp)), 3)
    results.update(
        {"quick": quick, "commits": config.commits, "blob_mb": config.blob_mb, "cpus": os.cpu_count()}
    )
    for key, value in results.items():
        console.print(f"  {key:>14}: {value}")
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2) + "\n")
    return results
