"""`deltaboard board serve` as an operator starts it: its tokens checked in one line, a
warning when it has none, its URL printed once it listens, and its API docs offline."""

from __future__ import annotations

import os
import re
import subprocess

import httpx

from deltaboard.board.server.api.server import free_port
from tests.support.processes import Watched
from tests.support.servers import VENV_BIN

CLI = [str(VENV_BIN / "deltaboard")]


def refused(tmp_path, *tokens: str, env: dict[str, str] | None = None) -> str:
    """`board serve` with these tokens must stop before serving, with one red line."""
    args = [*CLI, "board", "serve", "--data-dir", str(tmp_path), "--port", str(free_port())]
    for token in tokens:
        args += ["--token", token]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), done
    assert "listening" not in done.stdout
    return lines[0]


def test_tokens_the_board_would_refuse_are_one_line(tmp_path):
    assert "needs its scope" in refused(tmp_path, "publish-secret-1")
    assert "unknown token scope 'root'" in refused(tmp_path, "root:publish-secret-1")
    line = refused(tmp_path, "read:read-secret-1", "admin:SECRET")
    assert "at least 8 characters; the admin token has 6" in line and "SECRET" not in line
    line = refused(tmp_path, env={**os.environ, "DELTABOARD_TOKENS": "read:abc"})  # the environment too
    assert "at least 8 characters; the read token has 3" in line
    line = refused(tmp_path, "read:read-secret-1", env={**os.environ, "DELTABOARD_FSYNC": "sometimes"})
    assert line.startswith("error: invalid Settings: fsync: ")


def test_a_board_without_tokens_warns_and_says_its_url_once_it_listens(tmp_path):
    port = free_port()
    serve = [*CLI, "board", "serve", "--data-dir", str(tmp_path / "a"), "--port", str(port)]
    board = Watched(serve)
    try:
        line = board.wait_for_line(lambda text: "listening on" in text)
        assert line is not None and f"listening on http://127.0.0.1:{port} " in line, board.output()
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        assert "warning: no tokens: the board refuses every request" in board.output()
        # a second board on the same port never listens: it must not claim to
        second = subprocess.run(
            [
                *CLI,
                "board",
                "serve",
                "--data-dir",
                str(tmp_path / "b"),
                "--port",
                str(port),
                "--token",
                "read:abcdefgh",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode != 0 and "listening" not in second.stdout, second
        assert "address already in use" in second.stdout + second.stderr
    finally:
        board.stop()


def test_the_api_docs_need_nothing_outside_the_board(tmp_path):
    port = free_port()
    board = Watched(
        [*CLI, "board", "serve", "--data-dir", str(tmp_path), "--port", str(port), "--token", "read:abcdefgh"]
    )
    try:
        assert board.wait_for_line(lambda text: "listening on" in text) is not None, board.output()
        url = f"http://127.0.0.1:{port}"
        for page in ("/docs", "/redoc"):
            html = httpx.get(url + page).text
            assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html) + re.findall(
                r"url: ?'([^']+)'", html
            )
            assert assets, html
            for asset in assets:
                assert asset.startswith("/"), f"{page} loads {asset} from elsewhere"
                assert httpx.get(url + asset).status_code == 200, asset
    finally:
        board.stop()
