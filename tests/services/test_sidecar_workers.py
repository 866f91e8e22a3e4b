"""Several sidecar worker processes, one version loop: a swap stops admissions in every
worker before the engine is touched (`services.sidecar.workers`), `/metrics` is the
fleet's whichever worker a scrape reaches, and `bench sidecar` runs (its figures' keys, no
error and no missing stamp, across worker processes)."""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from deltaboard.clients.engines import make_adapter
from deltaboard.services.bench import sidecar_bench
from deltaboard.services.cli import build_app
from deltaboard.services.sidecar import workers
from deltaboard.services.sidecar.background import GC_YOUNG_THRESHOLD, listen
from deltaboard.services.sidecar.gate import VersionGate
from deltaboard.services.sidecar.metrics import SidecarMetrics
from deltaboard.services.sidecar.proxy import ProxySettings, create_proxy_app
from tests.services.fakes.fast_engine import fast_engine
from tests.services.fakes.polling import wait_until

WORKERS = 2
BODY = {"prompt": [1], "max_tokens": 2}
REPORT_KEYS = {
    "direct_tokens_per_s",
    "sidecar_tokens_per_s",
    "direct_rps",
    "sidecar_rps",
    "ttft_p50_added_ms",
    "ttft_p99_added_ms",
    "sidecar_cpu_us_per_token",
    "sidecar_cpu_ms_per_request",
    "errors",
    "missing_stamps",
    "ttft_paced_p50_added_ms",
    "ttft_paced_p99_added_ms",
    "ttft_paced_warm_p50_added_ms",
    "ttft_paced_warm_p99_added_ms",
    "busy_cores",
    "generator_cpu_us_per_token",
}


def _owner(engine_url: str, sock: Any, commands: Connection) -> None:
    """The sidecar's owner process: workers on `sock`, its loop driven by `commands`."""
    adapter = make_adapter("reference", engine_url)
    owners = SidecarMetrics()  # the owner's: the swaps, as a version loop records them

    def build(gate: VersionGate, metrics: SidecarMetrics, lifespan: workers.Lifespan) -> Any:
        def status() -> dict[str, Any]:  # with the worker's garbage collector, as it serves
            collector = {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()[0]}
            own = metrics.share(gate.inflight).outcomes.get("proxied", 0)  # this worker's alone
            return {
                "served": gate.served,
                "healthy": gate.healthy,
                "gc": collector,
                "pid": os.getpid(),
                "own": own,
            }

        return create_proxy_app(gate, adapter, ProxySettings(engine_url), metrics, status, lifespan)

    def own(fleet: workers.FleetGate, stop: threading.Event) -> None:
        commands.send(fleet.states())
        while (command := commands.recv()) != "stop":
            what, version = command
            if what == "begin":
                fleet.begin_swap(version)
            else:  # the engine loads it, and the workers serve it
                fleet.end_swap(version, 0.0, adapter.reload(Path(os.devnull), version, fleet.mode))
                owners.swaps.inc()
            commands.send(fleet.states())

    try:
        workers.serve(sock, build, own, WORKERS, "quiesce", owners)
    finally:
        os._exit(0)  # a forked test process: none of the test runner's exit handlers


def ask(url: str) -> httpx.Response:
    """One request on a connection of its own (the kernel picks the worker), not waiting."""
    headers = {"X-Weight-Version-Wait": "0"}
    return httpx.post(f"{url}/v1/completions", json=BODY, headers=headers, timeout=30)


@contextmanager
def _fleet() -> Iterator[tuple[str, Connection]]:
    """A sidecar of `WORKERS` workers in front of a fake engine: its URL and the owner's
    command pipe (`_owner`); stopped on the way out, the owner's exit checked."""
    sock = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with fast_engine() as engine_url:
        commands, theirs = multiprocessing.Pipe()
        owner = multiprocessing.get_context("fork").Process(target=_owner, args=(engine_url, sock, theirs))
        owner.start()
        sock.close()
        try:
            assert len(commands.recv()) == WORKERS  # every worker is up
            yield url, commands
            commands.send("stop")
            owner.join(60)
            assert owner.exitcode == 0
        finally:
            if owner.is_alive():
                owner.terminate()
                owner.join(10)


def _series(text: str, name: str) -> float:
    """The value of the one sample `name` (with its labels) in a Prometheus exposition."""
    (value,) = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


def test_metrics_are_the_fleets_whichever_worker_a_scrape_reaches() -> None:
    with _fleet() as (url, commands):
        commands.send(("end", 1))
        commands.recv()
        sent = 0
        with ThreadPoolExecutor(8) as pool:  # at once, so that both workers take some
            while sent < 400:
                assert {r.status_code for r in pool.map(ask, [url] * 40)} == {200}
                sent += 40
                own: dict[int, int] = {}  # each worker's own count, as its status says
                for _ in range(100):
                    status = httpx.get(f"{url}/healthz", timeout=30).json()
                    own[status["pid"]] = status["own"]
                    if len(own) == WORKERS:
                        break
                if len(own) == WORKERS and all(own.values()):
                    break
        assert len(own) == WORKERS and all(own.values()), own  # both served requests
        assert sum(own.values()) == sent, own
        for _ in range(8):  # whichever worker takes the scrape: the sums, and the owner's swaps
            text = httpx.get(f"{url}/metrics", timeout=30).text
            assert _series(text, 'deltaboard_sidecar_requests_total{outcome="proxied"}') == sent
            assert _series(text, "deltaboard_sidecar_version_wait_seconds_count") == sent
            assert _series(text, "deltaboard_sidecar_swaps_total") == 1
            assert _series(text, "deltaboard_sidecar_served_version") == 1
            assert _series(text, "deltaboard_sidecar_inflight") == 0


def test_a_scrape_is_answered_while_a_swap_waits_for_a_stream_to_drain() -> None:
    with _fleet() as (url, commands):
        commands.send(("end", 1))
        commands.recv()
        body = {**BODY, "max_tokens": 100, "stream": True, "step_ms": 20}  # two seconds of tokens
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            next(lines)  # under way
            commands.send(("begin", 2))  # quiesce: the owner's loop waits for the stream to end
            text = httpx.get(f"{url}/metrics", timeout=30).text
            assert not commands.poll()  # answered while the swap still waits
            assert _series(text, "deltaboard_sidecar_inflight") == 1
            assert _series(text, "deltaboard_sidecar_served_version") == 1
            assert any("[DONE]" in line for line in lines)
        assert all(s.swapping for s in commands.recv())
        commands.send(("end", 2))
        commands.recv()


def test_a_swap_stops_admissions_in_every_worker_before_the_engine_is_touched() -> None:
    with _fleet() as (url, commands):
        commands.send(("end", 1))
        assert all(s.served == 1 and not s.swapping for s in commands.recv())
        assert all(ask(url).headers["x-weight-version-end"] == "1" for _ in range(8))
        # every worker serves with its startup's objects out of the collector's passes
        collectors = [httpx.get(f"{url}/healthz", timeout=30).json()["gc"] for _ in range(8)]
        assert all(c["frozen"] > 0 and c["threshold"] == GC_YOUNG_THRESHOLD for c in collectors)

        commands.send(("begin", 2))
        states = commands.recv()
        assert len(states) == WORKERS and all(s.swapping and s.served == 1 for s in states)
        held = [ask(url) for _ in range(16)]  # whichever worker each one reaches
        assert {r.status_code for r in held} == {409}
        assert {r.json()["error"]["code"] for r in held} == {"WeightVersionNotReady"}

        commands.send(("end", 2))
        assert all(s.served == 2 and not s.swapping for s in commands.recv())
        answers = [ask(url) for _ in range(8)]
        assert all(r.json()["weight_version"] == {"start": 2, "end": 2, "spans": [[0, 2]]} for r in answers)


def test_the_bench_runs_across_workers_with_swaps_and_misses_no_stamp() -> None:
    config = sidecar_bench.BenchConfig(
        duration_s=1.0,
        streams=4,
        stream_tokens=16,
        requests=8,
        request_tokens=4,
        workers=WORKERS,
        swap_every_s=0.1,
        mode="quiesce",  # start == end: a worker admitting during another's swap would show
    )
    report = sidecar_bench.run(config, lambda what: None)
    assert set(report) >= REPORT_KEYS
    assert report["errors"] == 0 and report["missing_stamps"] == 0, report["first_error"]
    assert report["sidecar_tokens_per_s"] > 0 and report["sidecar_rps"] > 0
    assert report["sidecar_cpu_us_per_token"] > 0 and report["sidecar_cpu_ms_per_request"] > 0
    # the same load through a proxy that does nothing, the floor: served, and its CPU read
    floor = report["passthrough"]
    assert floor["tokens_per_s"] > 0 and floor["rps"] > 0, floor
    assert floor["cpu_us_per_token"] > 0 and floor["cpu_ms_per_request"] > 0, floor
    # a process's CPU is counted in 10 ms ticks, and the quick run's paced phase can spend
    # less than one in either process: reported, and never negative
    assert floor["paced_cpu_us_per_token"] >= 0 and report["sidecar_paced_cpu_us_per_token"] >= 0, floor
    assert all(ms > 0 for ms in (*floor["ttft_ms"], *floor["paced_ttft_ms"], *floor["latency_ms"])), floor
    # the paced phase is paced: no stream gets more than a token per engine step
    ceiling = config.streams * 1000 / config.paced_step_ms
    assert all(0 < rate <= ceiling for rate in report["paced"]["tokens_per_s"]), report["paced"]
    # each client's streams after its first are counted apart too (its connections open)
    assert all(ms > 0 for side in report["paced"]["warm_ttft_ms"].values() for ms in side), report["paced"]


def test_bench_sidecar_command_writes_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "sidecar.json"
    args = ["bench", "sidecar", "--duration", "0.5", "--swap-every", "0.2", "--json", str(out)]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report) >= REPORT_KEYS
    assert (
        report["workers"] == report["config"]["workers"] == workers.auto_workers()
    )  # as deployed by default
    every_core = sorted(os.sched_getaffinity(0))  # shared by every process
    assert set(report["placement"]) == {"engine", "pass-through", "load generator", "sidecar"}
    assert all(cores == every_core for cores in report["placement"].values()), report["placement"]
    assert report["errors"] == 0 and report["missing_stamps"] == 0, report["first_error"]


def test_bench_sidecar_gives_the_proxy_a_core_of_its_own(tmp_path: Path) -> None:
    """`--own-core`: the pass-through and the sidecar (owner and workers) on the last core,
    the engine and the load generator on the others, as each process reports it during the
    run; one worker for `--workers auto`, and this process's cores given back after."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("a core of the proxy's own needs two cores")
    out = tmp_path / "sidecar.json"
    args = ["bench", "sidecar", "--own-core", "--duration", "0.5", "--swap-every", "0.2", "--json", str(out)]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["config"]["own_core"] is True and report["workers"] == 1
    assert report["placement"] == {
        "engine": cores[:-1],
        "pass-through": cores[-1:],
        "load generator": cores[:-1],
        "sidecar": cores[-1:],
    }
    assert sorted(os.sched_getaffinity(0)) == cores
    assert report["errors"] == 0 and report["missing_stamps"] == 0, report["first_error"]


def _gone(pid: int) -> bool:
    """Ended: no such process, or one not reaped yet."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def test_workers_die_with_a_killed_owner_even_one_whose_loop_is_stuck() -> None:
    """SIGKILL to the owner: a worker that runs sees its owner's pipe end and exits; one
    that cannot run its loop (stopped here, as a worker stuck in a loop would be) is killed
    by the kernel (Linux), instead of living on with the listening port."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    sock = listen("127.0.0.1", 0)
    with fast_engine() as engine_url:
        commands, theirs = multiprocessing.Pipe()
        owner = multiprocessing.get_context("fork").Process(target=_owner, args=(engine_url, sock, theirs))
        owner.start()
        sock.close()
        assert owner.pid is not None
        pids: list[int] = []
        try:
            assert len(commands.recv()) == WORKERS  # every worker is up
            pids = [p.pid for p in psutil.Process(owner.pid).children()]
            assert len(pids) == WORKERS
            os.kill(pids[0], signal.SIGSTOP)  # its loop runs no more
            os.kill(owner.pid, signal.SIGKILL)
            owner.join(10)
            wait_until(lambda: all(_gone(pid) for pid in pids), "every worker ended with its owner", 30)
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if owner.is_alive():
                owner.kill()
