"""Shared fixtures: real servers on loopback.

- `board` (per test): a board process on a fresh data dir with admin/publish/read tokens,
  started while the test before ran (`BoardPool`).
  Its log is printed when the test fails, and a test whose board logged a traceback fails:
  a 500 that the client's retries hid is still a server bug.
- `s3_server` (per session): SeaweedFS with S3; `s3_server.make_bucket()` gives a fresh bucket.
- `redis_server` (per session): a Valkey/Redis URL.
"""

from __future__ import annotations

import tempfile
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.servers import BoardServer, S3Server, board_server, seaweedfs, valkey

# Files holding the suite's longest tests (measured with `--durations`), longest first.
# They run first: on two workers a long test that starts last runs on alone at the end,
# while short tests started last let both workers finish together.
LONG_FIRST = (
    "tests/chaos/",
    "tests/test_readme.py",
    "tests/services/test_demo.py",
    "tests/clients/test_kill.py",
    "tests/ui/",
    "tests/publisher/test_sharded.py",
    "tests/board/test_store_outage.py",
    "tests/board/test_schemathesis.py",
    "tests/publisher/test_distributed.py",
    "tests/clients/test_cli.py",
    "tests/board/test_replicas.py",
    "tests/board/test_board_serve.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of `LONG_FIRST` first, in its order (each file's own order kept); every
    worker collects the same order, as pytest-xdist requires."""

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, prefix in enumerate(LONG_FIRST) if path.startswith(prefix)), len(LONG_FIRST))

    items.sort(key=rank)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item, so that fixtures can tell a failed test."""
    report = yield
    item.stash.setdefault(PHASE_REPORTS, {})[report.when] = report
    return report


# No per-example deadline: it measures the machine, not the property, and a busy CI machine
# tripped hypothesis' default 200 ms on a pure function.
settings.register_profile("deltaboard", deadline=None)
settings.load_profile("deltaboard")

PHASE_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


def failed(request: pytest.FixtureRequest) -> bool:
    return any(r.failed for r in request.node.stash.get(PHASE_REPORTS, {}).values())


class BoardPool:
    """Boards started one test ahead: while a test runs, the next test's board imports and
    binds in a thread, so the ~100 tests that take a fresh board do not each wait a second
    for its start. Each board still has a data dir and tokens of its own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.starter = ThreadPoolExecutor(1, thread_name_prefix="board-pool")
        self.spare: Future[BoardServer] | None = None

    def _start(self) -> Future[BoardServer]:
        return self.starter.submit(lambda: board_server(Path(tempfile.mkdtemp(dir=self.root))).start())

    def take(self) -> BoardServer:
        taken = (self.spare or self._start()).result()
        self.spare = self._start()
        return taken

    def close(self) -> None:
        if self.spare is not None:
            self.spare.result().stop()
        self.starter.shutdown()


@pytest.fixture(scope="session")
def board_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BoardPool]:
    pool = BoardPool(tmp_path_factory.mktemp("boards"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def board(board_pool: BoardPool, request: pytest.FixtureRequest) -> Iterator[BoardServer]:
    server = board_pool.take()
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
