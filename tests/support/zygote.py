"""Boards forked from a process that has imported the board once.

Most of a board process's start is importing (FastAPI and its pydantic models, uvicorn,
boto3), and about 120 tests take a fresh board (more start their own): on a 2-core
machine those imports alone were minutes of the suite's CPU. The zygote (one per test
process, run as this file) imports the board's modules once, then forks one board per
request: the child takes the environment it is given, sends its output to the board's log
and runs `serve(Settings())`, as `python -m deltaboard.board.server.api` does. Each board
is still a process of its own, with its port, data dir and settings; only the imported
modules are shared (copied on write). The zygote is single-threaded, so forking it is
safe; `deltaboard board serve` and `spawn` themselves keep their own tests
(`tests/board/test_board_serve.py`).

The zygote answers one JSON line per request line on its stdin:
`{"op": "fork", "env": {...}, "log": PATH}` -> `{"pid": N}`, and
`{"op": "poll", "pid": N}` -> `{"code": null | exit status}` (a signal as a negative number,
as `subprocess` reports it); it exits at the end of its input.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any


class ForkedBoard:
    """A board forked by the zygote, with the part of `subprocess.Popen` the tests use. Its
    exit status comes from the zygote, its parent; a process that exited stays a zombie
    until polled, so its pid is not reused while this handle may signal it."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.args = ["board", str(pid)]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.ask({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The client side: starts the zygote and asks it for boards (from any thread)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._lock = threading.Lock()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        with self._lock:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the board zygote exited with {self.process.wait()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def fork(self, env: dict[str, str], log: str) -> ForkedBoard:
        """A board process with exactly `env` as its environment, writing to `log`."""
        return ForkedBoard(self, self.ask({"op": "fork", "env": env, "log": log})["pid"])

    def close(self) -> None:
        """The zygote exits; boards still running are their tests' to stop."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


# ---- the zygote process ------------------------------------------------------------------


def _board(env: dict[str, str], log: str) -> None:
    """The forked child: become the board described by `env`; never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for fd, target in ((null, 0), (out, 1), (out, 2)):
            os.dup2(fd, target)
        os.close(null)
        os.close(out)
        from deltaboard.board.server.api.server import serve
        from deltaboard.board.server.settings import Settings

        serve(Settings())
        code = 0
    except SystemExit as exc:  # uvicorn's exit when it cannot bind: it logged why
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    # What a board imports at its start, imported once here (the S3 store and the Redis
    # index as well: many tests run boards on them).
    import deltaboard.board.server.api.app
    import deltaboard.board.server.api.longpoll
    import deltaboard.board.server.api.server
    import deltaboard.board.server.index.redis
    import deltaboard.board.server.settings
    import deltaboard.board.server.storage.s3  # noqa: F401

    finished: dict[int, int] = {}
    for line in sys.stdin.buffer:
        request = json.loads(line)
        if request["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                _board(request["env"], request["log"])
            answer: dict[str, Any] = {"pid": pid}
        else:
            pid = request["pid"]
            if pid not in finished:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    finished[pid] = os.waitstatus_to_exitcode(status)
            answer = {"code": finished.get(pid)}
        sys.stdout.buffer.write(json.dumps(answer).encode() + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
