"""`deltaboard board serve`: flags reach the settings, and the server never imports torch."""

from __future__ import annotations

import subprocess
import sys

import httpx

from board.api.server import free_port
from tests.support.servers import stop_process, wait_until


def test_board_serve_with_flags(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    code = "import sys; from services.cli import main; sys.argv[0] = 'deltaboard'; main()\n"
    args = [
        sys.executable,
        "-c",
        code,
        "board",
        "serve",
        "--data-dir",
        str(tmp_path / "data"),
        "--port",
        str(port),
        "--token",
        "publish:cli-publish-token",
        "--anonymous-read",
        "--log-level",
        "info",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: httpx.get(f"{url}/healthz").status_code == 200, "deltaboard board serve", proc, log
        )
        auth = {"Authorization": "Bearer cli-publish-token"}
        assert httpx.post(f"{url}/v1/runs", json={"name": "r"}, headers=auth).status_code == 201
        assert httpx.get(f"{url}/v1/runs/r/head").json()["version"] is None  # anonymous read
        assert httpx.post(f"{url}/v1/runs", json={"name": "s"}).status_code == 401
        assert (tmp_path / "data" / "store" / "runs" / "r" / "run.json").exists()
    finally:
        stop_process(proc)


def test_board_server_does_not_import_torch():
    code = "import sys, board.api, board.storage.s3, board.index.redis; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
