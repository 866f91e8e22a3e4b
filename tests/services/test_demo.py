"""`deltaboard demo`, run for real (small settings) as a user runs it."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest


def output_until(process: subprocess.Popen[str], last: str, timeout_s: float) -> list[str]:
    """The lines `process` prints up to one containing `last` (a reader thread, so that a
    demo that hangs fails the test at `timeout_s` instead of blocking it)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not seen or last not in seen[-1]:
        line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        assert line is not None, "\n".join(seen[-60:])
        seen.append(line)
    return seen


def test_demo_converges_and_serves_every_pinned_version(tmp_path):
    """The demo as the README runs it (`--keep`): it converges, and the dashboard it prints
    serves the page while the board is kept up, until Ctrl-C."""
    summary = tmp_path / "summary.json"
    command = [
        sys.executable,
        "-c",
        "from deltaboard.services.cli import main; main()",
        "demo",
        "--steps=2",
        "--warmup=0",
        "--nodes=1",
        "--keep",
        f"--workdir={tmp_path / 'work'}",
        f"--json={summary}",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = output_until(process, "Ctrl-C stops them", timeout_s=240)
        printed = "\n".join(lines)
        dashboard = re.findall(r"^dashboard: (http://127\.0\.0\.1:\d+/ui)$", printed, re.M)
        token = re.findall(r"^read token to enter there: (\S+)$", printed, re.M)
        node_page = re.findall(r"^node-0 status page: (http://127\.0\.0\.1:\d+/ui)$", printed, re.M)
        # printed once when they come up and again once the demo is done
        assert len(dashboard) == len(token) == len(node_page) == 2, printed
        page = httpx.get(dashboard[-1], follow_redirects=True)
        assert page.status_code == 200 and "<title>deltaboard</title>" in page.text
        runs = httpx.get(
            dashboard[-1].removesuffix("/ui") + "/v1/runs", headers={"Authorization": f"Bearer {token[-1]}"}
        )
        assert runs.status_code == 200 and "demo" in runs.text
        status_page = httpx.get(node_page[-1], follow_redirects=True)
        assert status_page.status_code == 200 and "<title>deltaboard sidecar</title>" in status_page.text
        assert process.poll() is None  # kept up
        process.send_signal(signal.SIGINT)
        try:
            rest, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            dump, _ = process.communicate(timeout=30)
            raise AssertionError(dump[-15000:]) from None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, printed[-3000:] + rest[-3000:]
    with pytest.raises(httpx.ConnectError):  # the board stopped with the demo
        httpx.get(dashboard[-1])
    report = json.loads(summary.read_text())
    assert set(report) == {
        "versions",
        "seconds",
        "full_bytes",
        "mean_patch_bytes",
        "mean_changed_fraction",
        "nodes",
        "pinned_requests",
        "pinned_mismatches",
    }
    assert report["versions"] == 3  # the initial keyframe and one delta per step
    assert [n["id"] for n in report["nodes"]] == ["node-0"]
    assert all(n["converged"] and n["version"] == 2 for n in report["nodes"])
    assert report["pinned_requests"] == 3 and report["pinned_mismatches"] == 0
    assert 0 < report["mean_patch_bytes"] < report["full_bytes"] / 10
    assert 0 < report["mean_changed_fraction"] < 0.2
    assert "summary" in printed


def test_demo_refuses_an_unknown_commit_mode(tmp_path):
    command = [
        sys.executable,
        "-c",
        "from deltaboard.services.cli import main; main()",
        "demo",
        "--mode=eventually",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "quiesce" in done.stdout + done.stderr


def test_demo_as_a_trainer_for_an_existing_board(board, tmp_path):
    """What the compose file's trainer runs: publish to a board (found through
    DELTABOARD_URL, as every command finds it), no local nodes. It says what it does before
    it loads anything slow: its first line comes before torch is imported (`-X importtime`
    reports each import as it happens, on the same stream)."""
    summary = tmp_path / "summary.json"
    command = [
        sys.executable,
        "-X",
        "importtime",
        "-c",
        "from deltaboard.services.cli import main; main()",
        "demo",
        "--nodes=0",
        "--steps=2",
        "--warmup=0",
        f"--json={summary}",
    ]
    env = {**os.environ, "DELTABOARD_URL": board.url, "DELTABOARD_TOKEN": board.publish_token}
    done = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:]
    lines = done.stdout.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("deltaboard demo: "))
    assert f"the board at {board.url}" in lines[said]
    assert said < next(i for i, line in enumerate(lines) if re.search(r"\|\s+torch$", line))
    report = json.loads(summary.read_text())
    assert report["versions"] == 3 and report["nodes"] == [] and report["pinned_requests"] == 0
    assert board.client(board.read_token).head("demo").version == 2


def test_demo_fails_on_a_wrong_version_or_a_node_behind():
    from deltaboard.services.demo import DemoState, PinnedResult, VersionStats, succeeded, summary

    versions = [VersionStats(0, "full", 1.0, 100), VersionStats(1, "delta", 0.01, 5)]
    state = DemoState(steps=1, versions=versions)
    state.pinned.append(PinnedResult("node-0", 1, 200, (1, 1)))
    assert succeeded(summary(state, [], {}, 1.0))
    state.pinned.append(PinnedResult("node-0", 1, 200, (0, 1)))  # served across a swap: not version 1
    report = summary(state, [], {}, 1.0)
    assert report["pinned_mismatches"] == 1 and not succeeded(report)
    behind = {**summary(state, [], {}, 1.0), "pinned_mismatches": 0}
    behind["nodes"] = [{"id": "node-0", "version": 0, "converged": False}]
    assert not succeeded(behind)
