"""Running the board: in this process under uvicorn (`deltaboard board serve`,
`python -m deltaboard.board.server.api`), or as a child process for benchmarks and tests."""

from __future__ import annotations

import gc
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from deltaboard.board.contract.errors import InvalidRequest
from deltaboard.board.server.settings import Settings


class JSONErrorsProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol, answering a request its parser refuses before the app runs
    (a Content-Length beyond 64 bits, a malformed request line or header) with the board's
    JSON error body, as every other failure, instead of uvicorn's plain text."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(InvalidRequest(f"the HTTP request is malformed: {msg}").body()).encode()
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


# The cycle collector's generation thresholds while serving (Python's default: 700, 10, 10).
GC_THRESHOLDS = (50_000, 20, 20)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The board's app and uvicorn's settings for it, as `uvicorn.run` takes them."""
    from deltaboard.board.server.api.app import create_app
    from deltaboard.board.server.api.longpoll import LongPollFastPath, long_poll_protocol

    app = create_app(settings)
    return {
        # Outside every layer of the app, the framework's own included: the pollers'
        # requests skip them all (`longpoll`); with the embedded index they do not even
        # reach the app (`long_poll_protocol`).
        "app": LongPollFastPath(app, state=app.state.board),
        "http": long_poll_protocol(app.state.board),
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level.lower(),
        # Above `info` uvicorn's access lines are dropped, but it still formats their
        # arguments for every request: a thousand long-polls a second pay for nothing.
        "access_log": settings.log_level.lower() in ("trace", "debug", "info"),
        # Long-polls hold connections for up to a minute; keep idle ones a little longer.
        "timeout_keep_alive": 75,
        "backlog": 4096,
    }


def serve(settings: Settings) -> None:
    import uvicorn

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    options = uvicorn_options(settings)
    # Everything imported and built so far lives as long as the process: out of the cycle
    # collector's sight, a full collection walks only what serving creates (one that
    # walked the framework's objects too paused the loop while commits waited:
    # docs/design.md, "Load").
    gc.collect()
    gc.freeze()
    # Every poll allocates a few dozen containers that refcounting frees; at the default
    # thresholds the young generation was collected every few dozen polls, walking the
    # parked polls' live state again each time (~10% of the loop's time, py-spy).
    gc.set_threshold(*GC_THRESHOLDS)
    uvicorn.run(**options)


def free_port() -> int:
    """A loopback port that was free a moment ago (for child boards in benches and tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PortTaken(RuntimeError):
    """The board could not listen on its port: another process took it first."""


def spawn(env: dict[str, str], log: Path, timeout_s: float = 60.0) -> subprocess.Popen[bytes]:
    """Start `python -m deltaboard.board.server.api` with DELTABOARD_* settings in `env` (plus this process's
    environment; DELTABOARD_PORT is required), wait until /healthz answers, and return the
    process. The answer must carry this process's instance nonce: a port found free a
    moment earlier may have been taken by another server (`PortTaken`), which would
    otherwise answer in the board's place."""
    host = env.get("DELTABOARD_HOST", "127.0.0.1")
    url = f"http://{host}:{env['DELTABOARD_PORT']}/healthz"
    instance = secrets.token_hex(8)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltaboard.board.server.api"],
            env={**os.environ, **env, "DELTABOARD_INSTANCE": instance},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            error = PortTaken if "address already in use" in tail else RuntimeError
            raise error(f"board exited with {proc.returncode}: {tail}")
        try:
            answer = httpx.get(url, timeout=1.0)
            if answer.status_code == 200 and answer.json().get("instance") == instance:
                return proc
        except (httpx.TransportError, ValueError, AttributeError):
            pass
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"board did not answer {url} within {timeout_s}s")
