"""Shared fixtures: real servers on loopback.

- `board` (per test): a board process on a fresh data dir with admin/publish/read tokens.
  Its log is printed when the test fails, and a test whose board logged a traceback fails:
  a 500 that the client's retries hid is still a server bug.
- `s3_server` (per session): SeaweedFS with S3; `s3_server.make_bucket()` gives a fresh bucket.
- `redis_server` (per session): a Valkey/Redis URL.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.support.servers import BoardServer, S3Server, board_server, seaweedfs, valkey


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item, so that fixtures can tell a failed test."""
    report = yield
    item.stash.setdefault(PHASE_REPORTS, {})[report.when] = report
    return report


PHASE_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


def failed(request: pytest.FixtureRequest) -> bool:
    return any(r.failed for r in request.node.stash.get(PHASE_REPORTS, {}).values())


@pytest.fixture
def board(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[BoardServer]:
    server = board_server(tmp_path / "board").start()
    try:
        yield server
    finally:
        server.stop()
        if failed(request):
            print(f"---- board log ({server.log}) ----\n{server.log_text()[-20000:]}")
    server.check_log()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with valkey(tmp_path_factory.mktemp("valkey")) as url:
        yield url
