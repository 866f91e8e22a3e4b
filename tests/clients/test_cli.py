"""`deltaboard pull` and `deltaboard follow` as processes, configured by environment."""

from __future__ import annotations

import signal
import subprocess
import time

from deltaboard.clients.follower.verify import served
from tests.clients.support import assert_view, publish_states
from tests.support.servers import VENV_BIN

SIZES = {"a.weight": (128, 64), "b.weight": (64,)}


def test_pull_follow_and_errors(board, tmp_path):
    client = board.client(board.publish_token)
    views = publish_states(client, "cli", SIZES, 2)
    env = {"DELTABOARD_URL": board.url, "DELTABOARD_TOKEN": board.read_token, "PATH": str(VENV_BIN)}
    d = tmp_path / "node"
    cmd = [str(VENV_BIN / "deltaboard")]
    pulled = subprocess.run(
        [*cmd, "pull", "--run", "cli", "--to", str(d), "--version", "0"], env=env, capture_output=True
    )
    assert pulled.returncode == 0, pulled.stderr
    assert b"None -> 0" in pulled.stdout
    assert_view(d, views[0])

    follow = subprocess.Popen(
        [*cmd, "follow", "--run", "cli", "--to", str(d)], env=env, stdout=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while served(d).version != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert served(d).version == 1
        assert_view(d, views[1])
    finally:
        follow.send_signal(signal.SIGTERM)
        out, _ = follow.communicate(timeout=30)
    assert follow.returncode == 0
    assert b"serving version 1" in out and b"stopped" in out

    missing = subprocess.run(
        [*cmd, "pull", "--run", "nope", "--to", str(tmp_path / "x")], env=env, capture_output=True
    )
    assert missing.returncode == 1
    assert b"BoardError" in missing.stdout
