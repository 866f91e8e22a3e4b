"""`deltaboard demo`, run for real (small settings) as a user runs it."""

from __future__ import annotations

import contextlib
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
import psutil
import pytest


class Output:
    """Everything `process` prints, read by one thread, the only reader of its stdout: what
    it prints last (a faulthandler dump included) is never taken by another reader, and a
    demo that hangs fails the test at a timeout instead of blocking it."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.seen: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def until(self, last: str, timeout_s: float) -> str:
        """What it printed up to a line containing `last`."""
        deadline = time.monotonic() + timeout_s
        while not self.seen or last not in self.seen[-1]:
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert line is not None, "\n".join(self.seen[-60:])
            self.seen.append(line)
        return "\n".join(self.seen)

    def rest(self, timeout_s: float) -> str:
        """What it printed after the last `until`, up to the end of its stdout, which comes
        once every process holding the pipe has gone (the test fails naming any left)."""
        lines, deadline = [], time.monotonic() + timeout_s
        try:
            while (line := self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))) is not None:
                lines.append(line)
        except queue.Empty:
            raise AssertionError(f"the demo's stdout is held open by {self.holders()}") from None
        return "\n".join(lines)

    def holders(self) -> list[str]:
        """The command lines of the processes holding the demo's stdout pipe."""
        assert self.process.stdout is not None
        pipe = f"pipe:[{os.fstat(self.process.stdout.fileno()).st_ino}]"
        found = []
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, OSError):
                fds = os.listdir(f"/proc/{process.pid}/fd")
                if any(os.readlink(f"/proc/{process.pid}/fd/{fd}") == pipe for fd in fds):
                    found.append(" ".join(process.info["cmdline"] or []))
        return found


def start_demo(*args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", "from deltaboard.services.cli import main; main()", "demo", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def alive(processes: list[psutil.Process]) -> list[str]:
    """The command lines of those of `processes` still running (a zombie has stopped)."""
    running = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(" ".join(process.cmdline()))
    return running


def gone(processes: list[psutil.Process], timeout_s: float) -> list[str]:
    """Wait for `processes` to stop: those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_demo_converges_and_serves_every_pinned_version(tmp_path):
    """The demo as the README runs it (`--keep`): it converges, and the dashboard it prints
    serves the page while the board is kept up, until Ctrl-C, which stops every process
    the demo started."""
    summary = tmp_path / "summary.json"
    process = start_demo(
        "--steps=2",
        "--warmup=0",
        "--nodes=1",
        "--keep",
        f"--workdir={tmp_path / 'work'}",
        f"--json={summary}",
    )
    output = Output(process)
    try:
        printed = output.until("Ctrl-C stops them", timeout_s=240)
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
        children = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            process.wait(timeout=30)
            raise AssertionError(output.rest(timeout_s=30)[-15000:]) from None
        rest = output.rest(timeout_s=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, printed[-3000:] + rest[-3000:]
    assert not alive(children)  # each was waited for before the demo exited
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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_demo_leaves_no_process_behind(tmp_path, sig):
    """SIGKILL leaves the demo no chance to stop what it started: its board and engine
    (serving, past their start) still go, told by the kernel that their parent died, and
    none of them holds the demo's stdout. SIGTERM stops it as Ctrl-C does (exit 130)."""
    process = start_demo("--steps=1", "--warmup=0", "--nodes=1", f"--workdir={tmp_path / 'work'}")
    output = Output(process)
    try:
        output.until("training; each step is published", timeout_s=240)  # board and engine serve
        children = psutil.Process(process.pid).children(recursive=True)
        commands = [" ".join(child.cmdline()) for child in children]
        assert any("board serve" in c for c in commands) and any(" engine " in c for c in commands), commands
        process.send_signal(sig)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not gone(children, timeout_s=120)
    rest = output.rest(timeout_s=60)
    if sig == signal.SIGTERM:
        assert process.returncode == 130 and "interrupted" in rest, (process.returncode, rest[-3000:])


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
