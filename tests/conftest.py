"""Shared fixtures: real servers on loopback.

- `board` (per test): a board process on a fresh data dir with admin/publish/read tokens.
- `s3_server` (per session): SeaweedFS with S3; `s3_server.make_bucket()` gives a fresh bucket.
- `redis_server` (per session): a Valkey/Redis URL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import BoardServer, S3Server, board_server, seaweedfs, valkey


@pytest.fixture
def board(tmp_path: Path) -> Iterator[BoardServer]:
    server = board_server(tmp_path / "board").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with valkey(tmp_path_factory.mktemp("valkey")) as url:
        yield url
