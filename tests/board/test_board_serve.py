"""`deltaboard board serve`: flags reach the settings, and the server never imports torch."""

from __future__ import annotations

import gc
import http.server
import subprocess
import sys
import threading

import httpx
import pytest
import uvicorn

from deltaboard.board.server.api.server import PortTaken, free_port, serve, spawn
from deltaboard.board.server.settings import Settings
from tests.support.servers import stop_process, wait_until


def test_board_serve_with_flags(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    code = "import sys; from deltaboard.services.cli import main; sys.argv[0] = 'deltaboard'; main()\n"
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
    code = (
        "import sys, deltaboard.board.server.api, deltaboard.board.server.storage.s3,"
        " deltaboard.board.server.index.redis; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_spawn_does_not_mistake_another_server_on_its_port_for_the_board(tmp_path):
    """Another process (another test run on this machine) may take a port found free a
    moment earlier; its /healthz must not pass for the board's."""

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "15")
            self.end_headers()
            self.wfile.write(b'{"status":"ok"}')

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor) as impostor:
        threading.Thread(target=impostor.serve_forever, daemon=True).start()
        env = {"DELTABOARD_DATA_DIR": str(tmp_path), "DELTABOARD_PORT": str(impostor.server_address[1])}
        with pytest.raises(PortTaken):
            spawn(env, tmp_path / "board.log", timeout_s=30)
        impostor.shutdown()


def test_serve_hides_what_it_built_from_the_cycle_collector(tmp_path, monkeypatch):
    """What serving starts with (modules, the app, its models) lives as long as the process;
    a full collection that walked it paused the loop while commits waited (`serve`)."""
    frozen: list[int] = []
    monkeypatch.setattr(uvicorn, "run", lambda **options: frozen.append(gc.get_freeze_count()))
    try:
        serve(Settings(data_dir=tmp_path))
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000
