"""`kill -9` a real `deltaboard pull` process at random instants; a restart must converge.

Each target version is pulled by a subprocess that is killed (SIGKILL) again and again,
then allowed to finish. Every other kill comes after a random delay drawn over the
duration of an uninterrupted pull; the others come a random few milliseconds after the
journal shows a slot being written, since writes are short next to downloads and uniform
instants would rarely land in them.
The follower reaches the board through an emulated 100 Mbit/s link (the benchmarks'
rate-limited proxy), as a remote node would, so that downloads take long enough to be hit.
After every kill the directory must serve some published version bit for bit (or none
yet); after the final run it must serve the target. The test also checks that its kills
really landed inside downloads (partial blobs left) and inside applies (a dirty slot),
so that it cannot pass by only killing idle processes.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

from deltaboard.clients.follower.journal import Journal
from deltaboard.clients.follower.verify import served
from deltaboard.services.bench.link import LinkProcess
from tests.clients.support import assert_view, publish_states
from tests.support.servers import VENV_BIN

SIZES = {f"layers.{i}.weight": (1024, 1024) for i in range(6)}  # 12 MiB of bf16 view


def pull(link: LinkProcess, board, directory: Path, version: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            str(VENV_BIN / "deltaboard"),
            "pull",
            "--run",
            "k",
            "--to",
            str(directory),
            "--version",
            str(version),
            "--workers",
            "2",
        ],
        env={"DELTABOARD_URL": link.url, "DELTABOARD_TOKEN": board.read_token, "PATH": str(VENV_BIN)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def timed_pull(link: LinkProcess, board, directory: Path, version: int) -> float:
    started = time.monotonic()
    proc = pull(link, board, directory, version)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]
    return time.monotonic() - started


def writing(directory: Path) -> bool:
    """Whether the journal shows a slot being written."""
    state = Journal(directory / ".deltaboard" / "journal.json").read()
    return state is not None and any(r.state == "dirty" for r in state.slots.values())


def interrupted_state(directory: Path) -> set[str]:
    """What a kill left behind: partial downloads and/or a slot marked dirty."""
    found = set()
    if any((directory / ".deltaboard").glob("cache/blobs/*.part")):
        found.add("download")
    if writing(directory):
        found.add("apply")
    return found


def wait_for_a_write(proc: subprocess.Popen[bytes], directory: Path, rng: random.Random) -> None:
    """Return a random 0-20 ms after the journal shows a write, or when `proc` exits."""
    while proc.poll() is None and not writing(directory):
        time.sleep(0.001)
    time.sleep(rng.uniform(0, 0.02))


def test_kill_at_random_instants_converges_bit_exact(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "k", SIZES, 8, keyframe_every=5)
    rng = random.Random(1234)
    with LinkProcess("127.0.0.1", board.port, 0.1) as link:
        full = timed_pull(link, board, tmp_path / "reference", 7)  # bootstrap + deltas, uninterrupted
        idle = timed_pull(link, board, tmp_path / "reference", 7)  # nothing to do: start-up only
        d = tmp_path / "node"
        hits, kills = kill_and_restart(link, board, d, views, rng, (idle / 2, full))
    print(f"{kills} kills, landed in {sorted(hits)}; pull {full:.2f} s, start-up {idle:.2f} s")
    assert kills >= 5  # most of the 24 attempts land; a loaded machine finishes some pulls first
    assert hits == {"download", "apply"}, hits
    check = subprocess.run([str(VENV_BIN / "deltaboard"), "verify", str(d)], capture_output=True)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()


def kill_and_restart(link, board, d, views, rng, window) -> tuple[set[str], int]:
    """Pull a sequence of targets (bootstrap, deltas, keyframe chains, backwards), each
    killed up to three times before a run is allowed to finish."""
    hits: set[str] = set()
    kills = 0
    for target in (3, 7, 2, 6, 1, 7, 0, 5):
        for attempt in range(3):
            proc = pull(link, board, d, target)
            if attempt % 2:
                wait_for_a_write(proc, d, rng)
            else:
                time.sleep(rng.uniform(*window))
            if proc.poll() is not None:
                assert proc.returncode == 0, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
                break
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            hits |= interrupted_state(d)
            if (d / "current").is_symlink():
                assert_view(d, views[served(d).version])  # whatever is served is one exact version
        timed_pull(link, board, d, target)
        assert served(d).version == target
        assert_view(d, views[target])
    return hits, kills
