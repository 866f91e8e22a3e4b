"""The tests' own servers start on loopback ports found free a moment before: one taken in
between (by another server, or by a connection's ephemeral port) must not fail the run."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from deltaboard.board.server.api.server import free_port as any_free_port
from tests.support import servers


@pytest.fixture
def taken_first(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A port held by a listening socket, handed out by the first `free_port` call of the
    tests' servers (later calls: ports free a moment ago, as before)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        picks = iter([held.getsockname()[1]])
        monkeypatch.setattr(servers, "free_port", lambda: next(picks, None) or any_free_port())
        yield held.getsockname()[1]


def test_seaweedfs_starts_again_on_fresh_ports_when_one_was_taken(tmp_path: Path, taken_first: int) -> None:
    with servers.seaweedfs(tmp_path / "seaweedfs") as server:
        bucket = server.make_bucket("after-a-taken-port")
        server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
        assert server.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"
    assert "address already in use" in (tmp_path / "seaweedfs" / "weed.log").read_text()


def test_valkey_starts_on_another_port_when_the_one_found_free_was_taken(
    tmp_path: Path, taken_first: int
) -> None:
    server = servers.ValkeyServer(tmp_path / "valkey")
    try:
        server.start()
        assert server.port != taken_first
        with redis.Redis.from_url(server.url) as r:
            assert r.ping()
    finally:
        server.stop()
    assert "address already in use" in (tmp_path / "valkey" / "valkey.log").read_text().lower()
