"""`deltaboard engine` and `deltaboard sidecar` as processes, the way an operator runs them."""

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


def test_engine_and_sidecar_processes_serve_a_published_version(board, tmp_path):
    engine_port, sidecar_port = free_port(), free_port()
    logs = {name: tmp_path / f"{name}.log" for name in ("engine", "sidecar")}
    with logs["engine"].open("wb") as out:
        engine = subprocess.Popen(
            [*CLI, "engine", f"--model={tmp_path / 'dir'}", f"--port={engine_port}"], stdout=out, stderr=out
        )
    model = build_model("tiny", seed=2)
    config: Any = model.config
    assets = {"config.json": config.to_json_string().encode()}
    with Publisher(board.url, "cli", token=board.publish_token, assets=assets) as publisher:
        publisher.publish(model).result()
    with logs["sidecar"].open("wb") as out:
        sidecar = subprocess.Popen(
            [
                *CLI,
                "sidecar",
                f"--board={board.url}",
                "--run=cli",
                f"--dir={tmp_path / 'dir'}",
                f"--engine=http://127.0.0.1:{engine_port}",
                "--engine-kind=reference",
                f"--port={sidecar_port}",
                "--node-id=cli-node",
                "--poll=1",
            ],
            env={"DELTABOARD_TOKEN": board.read_token, "PATH": ""},
            stdout=out,
            stderr=out,
        )
    try:
        wait_for(f"http://127.0.0.1:{sidecar_port}/healthz", sidecar, logs["sidecar"])
        body = {"prompt": "hi", "max_tokens": 2, "logprobs": 0, "weight_version": {"exact": 0}}
        answer = httpx.post(f"http://127.0.0.1:{sidecar_port}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["weight_version"] == {"start": 0, "end": 0}
        assert httpx.get(f"http://127.0.0.1:{engine_port}/health").json()["weight_version"] == 0
    finally:
        for process in (sidecar, engine):
            process.terminate()
            process.wait(30)
    # a graceful stop: uvicorn re-raises the SIGTERM it handled once it has shut down
    assert sidecar.returncode in (0, -signal.SIGTERM) and engine.returncode in (0, -signal.SIGTERM)
