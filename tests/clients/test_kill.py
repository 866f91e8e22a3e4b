"""`kill -9` a real `deltaboard pull` process inside its downloads and inside its writes; a
restart must converge.

Each target version is pulled by a subprocess that is killed (SIGKILL) twice, then allowed
to finish. The kills are armed on what the process itself shows, not on delays measured
on this machine, so that every phase gets its kills whatever the machine's speed or load:
one kill comes a random few milliseconds after the download has written its first bytes
(the pull names the phase, then a partial file appears in its cache), the other a random
few milliseconds after the pull says it is applying (the journal marks the slot dirty
before that line). The follower reaches the board through an emulated 100 Mbit/s link
(the benchmarks' rate-limited proxy), as a remote node would, so that downloads last.
After every kill the directory must serve some published version bit for bit (or none
yet); after the final run it must serve the target. The test also checks that its kills
really landed inside downloads (partial blobs left) and inside applies (a dirty slot), so
that it cannot pass by only killing idle processes.

The default run pulls four targets (a bootstrap, a catch-up of deltas, back over a
keyframe, forward again); `slow` adds the long sequence.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from deltaboard.clients.follower.journal import Journal
from deltaboard.clients.follower.verify import served
from deltaboard.services.bench.link import LinkProcess
from tests.clients.support import assert_view, publish_states
from tests.support.processes import Watched
from tests.support.servers import VENV_BIN

SIZES = {f"layers.{i}.weight": (1024, 1024) for i in range(6)}  # 12 MiB of bf16 view
SHORT = (3, 7, 1, 5)
LONG = (3, 7, 2, 6, 1, 7, 0, 5)


def pull(link: LinkProcess, board, directory: Path, version: int) -> Watched:
    return Watched(
        [
            str(VENV_BIN / "deltaboard"),
            "pull",
            "--run",
            "k",
            "--dir",
            str(directory),
            "--version",
            str(version),
            "--workers",
            "2",
        ],
        env={"DELTABOARD_URL": link.url, "DELTABOARD_TOKEN": board.read_token, "PATH": str(VENV_BIN)},
    )


def writing(directory: Path) -> bool:
    """Whether the journal shows a slot being written."""
    state = Journal(directory / ".deltaboard" / "journal.json").read()
    return state is not None and any(r.state == "dirty" for r in state.slots.values())


def partial_downloads(directory: Path) -> bool:
    return any((directory / ".deltaboard").glob("cache/blobs/*.part"))


def interrupted_state(directory: Path) -> set[str]:
    """What a kill left behind: partial downloads and/or a slot marked dirty."""
    found = set()
    if partial_downloads(directory):
        found.add("download")
    if writing(directory):
        found.add("apply")
    return found


def armed(proc: Watched, directory: Path, phase: str) -> bool:
    """Wait until `proc` is inside `phase` by its own account; False if it ended first."""
    label = {"download": "downloading", "apply": "applying"}[phase]
    if proc.wait_for_line(lambda line: line.startswith(label)) is None:
        return False
    while phase == "download" and not partial_downloads(directory):
        if proc.process.poll() is not None:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize(
    "targets", [pytest.param(SHORT, id="short"), pytest.param(LONG, id="long", marks=pytest.mark.slow)]
)
def test_kill_inside_downloads_and_writes_converges_bit_exact(board, tmp_path, targets):
    views = publish_states(board.client(board.publish_token), "k", SIZES, 8, keyframe_every=5)
    rng = random.Random(1234)
    hits: set[str] = set()
    kills = 0
    d = tmp_path / "node"
    with LinkProcess("127.0.0.1", board.port, 0.1) as link:
        for target in targets:
            for phase in ("download", "apply"):
                proc = pull(link, board, d, target)
                if armed(proc, d, phase):
                    time.sleep(rng.uniform(0, 0.01))
                code = proc.stop(signal.SIGKILL)
                if code != -signal.SIGKILL:  # it finished before the kill: fine, not a kill
                    assert code == 0, proc.output()
                    continue
                kills += 1
                hits |= interrupted_state(d)
                if (d / "current").is_symlink():
                    assert_view(d, views[served(d).version])  # whatever is served is one exact version
            finished = pull(link, board, d, target)
            assert finished.finish() == 0, finished.output()
            assert served(d).version == target
            assert_view(d, views[target])
    print(f"{kills} kills, landed in {sorted(hits)}")
    assert hits == {"download", "apply"}, hits
    check = Watched([str(VENV_BIN / "deltaboard"), "verify", "--dir", str(d)])
    assert check.finish() == 0, check.output()
