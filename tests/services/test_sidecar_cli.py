"""`deltaboard engine` and `deltaboard sidecar` as processes, the way an operator runs them:
serving a version, what the engine says when it starts, a second sidecar on a taken port,
a refused token."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from deltaboard.clients.follower import Follower
from deltaboard.publisher.publisher import Publisher
from deltaboard.services.trajectory import build_model

CLI = [sys.executable, "-c", "from deltaboard.services.cli import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"exited with {process.returncode}: {log.read_text()[-2000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url}: {log.read_text()[-2000:]}")


def sidecar_process(board_url: str, directory: Path, engine_url: str, port: int) -> list[str]:
    return [
        *CLI,
        "sidecar",
        f"--board={board_url}",
        "--run=cli",
        f"--dir={directory}",
        f"--engine={engine_url}",
        f"--port={port}",
        "--poll=1",
    ]


def test_engine_and_sidecar_processes_serve_and_a_sidecar_on_a_taken_port_never_touches_the_engine(
    board, tmp_path
):
    engine_port, sidecar_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    env = {"DELTABOARD_TOKEN": board.read_token, "PATH": ""}
    logs = {name: tmp_path / f"{name}.log" for name in ("engine", "sidecar")}
    with logs["engine"].open("wb") as out:
        engine = subprocess.Popen(
            [*CLI, "engine", f"--dir={tmp_path / 'dir'}", f"--port={engine_port}"], stdout=out, stderr=out
        )
    # The engine must have looked at its directory before the sidecar creates it: wait until
    # it listens (its import of torch can outlast the publish below on a busy machine).
    wait_for(f"{engine_url}/health", engine, logs["engine"])
    model = build_model("tiny", seed=2)
    config: Any = model.config
    assets = {"config.json": config.to_json_string().encode()}
    with Publisher(board.url, "cli", token=board.publish_token, assets=assets) as publisher:
        publisher.publish(model).result()
    with logs["sidecar"].open("wb") as out:
        sidecar = subprocess.Popen(
            sidecar_process(board.url, tmp_path / "dir", engine_url, sidecar_port),
            env=env,
            stdout=out,
            stderr=out,
        )
    try:
        wait_for(f"http://127.0.0.1:{sidecar_port}/healthz", sidecar, logs["sidecar"])
        body = {"prompt": "hi", "max_tokens": 2, "logprobs": 0, "weight_version": {"exact": 0}}
        answer = httpx.post(f"http://127.0.0.1:{sidecar_port}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200
        assert answer.json()["weight_version"] == {"start": 0, "end": 0, "spans": [[0, 0]]}
        health = httpx.get(f"{engine_url}/health").json()
        # at least one load (a reload the sidecar timed out on under load is retried)
        assert health["weight_version"] == 0 and health["loads"] >= 1
        loads = health["loads"]
        said = logs["engine"].read_text()
        assert "does not exist: the engine serves nothing (503) until POST /reload" in said
        assert f"listening on {engine_url}, serving nothing yet" in said

        # A second sidecar on the first one's port, with a directory of its own that holds a
        # version: it must fail to listen before it ever asks the engine to load anything.
        with Follower(board.client(board.read_token), "cli", tmp_path / "other", node_id="o") as follower:
            follower.sync(0)
        second = subprocess.run(
            sidecar_process(board.url, tmp_path / "other", engine_url, sidecar_port),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 1 and "Traceback" not in second.stderr
        assert f"cannot listen on 127.0.0.1:{sidecar_port}" in second.stderr
        assert httpx.get(f"{engine_url}/health").json()["loads"] == loads
    finally:
        for process in (sidecar, engine):
            process.terminate()
            process.wait(30)
    # a graceful stop: uvicorn re-raises the SIGTERM it handled once it has shut down
    assert sidecar.returncode in (0, -signal.SIGTERM) and engine.returncode in (0, -signal.SIGTERM)


def test_a_sidecar_whose_token_is_refused_exits_with_the_reason(board, tmp_path):
    refused = subprocess.run(
        sidecar_process(board.url, tmp_path / "dir", "http://127.0.0.1:9", free_port()),
        env={"PATH": "", "DELTABOARD_TOKEN": "not-a-token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "the sidecar stopped: Unauthorized" in refused.stderr
