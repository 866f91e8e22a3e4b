"""The README's "Using it" section, run as a new user runs it: every command block, in order.

Each fenced block is run as written, in one fresh directory: `export` lines set the
environment of the commands after them, `python` blocks run as scripts, and every other
line is a command. Commands that do not end by themselves (the board, `follow`, the engine,
the sidecar) are started in the background and checked to come up; they are stopped at the
end of their block, the board at the end of the section. The only change made to the text
is the ports: 8080, 9000 and 8100 become free ones, so that the test can run beside others.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from deltaboard.board.server.api.server import free_port
from tests.support.processes import Watched
from tests.support.servers import VENV_BIN

README = Path(__file__).resolve().parent.parent / "README.md"
PORTS = ("8080", "9000", "8100")
TIMEOUT_S = 240.0


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of `text`: (language, body)."""
    return [(m[1], m[2]) for m in re.finditer(r"```(\w+)\n(.*?)```", text, re.S)]


def commands(body: str) -> Iterator[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            yield words


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def option(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def readiness(words: list[str], job: Watched) -> Callable[[], bool] | None:
    """How to tell that a long-running command is up (None: it ends by itself)."""
    if words[:3] == ["deltaboard", "board", "serve"]:
        return lambda: "listening on" in job.output()
    if words[:2] == ["deltaboard", "follow"]:
        return lambda: "following" in job.output()
    if words[:2] == ["deltaboard", "engine"]:
        return lambda: answers(f"http://127.0.0.1:{option(words, '--port')}/health")
    if words[:2] == ["deltaboard", "sidecar"]:
        return lambda: answers(f"http://127.0.0.1:{option(words, '--port')}/healthz")
    return None


def stopped(job: Watched) -> None:
    """SIGTERM, as a service manager stops it: a clean stop (uvicorn re-raises the SIGTERM
    it handled once it has shut down)."""
    assert job.stop() in (0, -signal.SIGTERM), job.output()


def is_service(words: list[str]) -> bool:
    return words[:3] == ["deltaboard", "board", "serve"] or words[:2] in (
        ["deltaboard", "follow"],
        ["deltaboard", "engine"],
        ["deltaboard", "sidecar"],
    )


@pytest.mark.timeout(900)
def test_the_using_it_section_runs_as_written(tmp_path):
    text = section(README.read_text(), "Using it")
    for port in PORTS:
        assert port in text  # the ports the test moves are the ones the README uses
        text = text.replace(port, str(free_port()))
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DELTABOARD_URL", None)
    env.pop("DELTABOARD_TOKEN", None)
    board: Watched | None = None
    outputs: list[str] = []
    try:
        for language, body in blocks(text):
            if language == "python":
                script = tmp_path / "snippet.py"
                script.write_text(body)
                done = subprocess.run(
                    [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
                )
                assert done.returncode == 0, done.stdout + done.stderr
                continue
            assert language == "bash", language
            running: list[Watched] = []
            try:
                for words in commands(body):
                    if words[0] == "export":
                        for assignment in words[1:]:
                            name, _, value = assignment.partition("=")
                            env[name] = value
                        continue
                    if not is_service(words):
                        done = subprocess.run(
                            words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
                        )
                        assert done.returncode == 0, f"{shlex.join(words)}:\n{done.stdout}{done.stderr}"
                        outputs.append(done.stdout)
                        continue
                    job = Watched(words, env=env, cwd=tmp_path)
                    ready = readiness(words, job)
                    assert ready is not None
                    job.wait_until(ready, shlex.join(words))
                    if words[1] == "board":
                        board = job
                    else:
                        running.append(job)
            finally:
                for job in reversed(running):
                    stopped(job)
    finally:
        if board is not None:
            stopped(board)
            assert "Traceback" not in board.output(), board.output()
    # the completion through the sidecar came back stamped with the version it was served with
    answer = json.loads(outputs[-1])
    assert answer["weight_version"]["start"] >= 3, answer
