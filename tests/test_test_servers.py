"""The tests' own servers start on loopback ports found free a moment before: one taken in
between (by another server, or by a connection's ephemeral port) must not fail the run."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltaboard.board.server.api.server import free_port as any_free_port
from tests.support import servers


def test_seaweedfs_starts_again_on_fresh_ports_when_one_was_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks: Iterator[int] = iter([taken.getsockname()[1]])  # the first port asked for is held

    def free_port() -> int:
        return next(picks, None) or any_free_port()

    monkeypatch.setattr(servers, "free_port", free_port)
    try:
        with servers.seaweedfs(tmp_path / "seaweedfs") as server:
            bucket = server.make_bucket("after-a-taken-port")
            server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
            assert server.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"
    finally:
        taken.close()
    assert "address already in use" in (tmp_path / "seaweedfs" / "weed.log").read_text()


def test_valkey_starts_on_another_port_when_the_one_found_free_was_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks: Iterator[int] = iter([taken.getsockname()[1]])
    monkeypatch.setattr(servers, "free_port", lambda: next(picks, None) or any_free_port())
    server = servers.ValkeyServer(tmp_path / "valkey")
    try:
        server.start()
        assert server.port != taken.getsockname()[1]
        import redis

        with redis.Redis.from_url(server.url) as r:
            assert r.ping()
    finally:
        server.stop()
        taken.close()
    assert "address already in use" in (tmp_path / "valkey" / "valkey.log").read_text().lower()
