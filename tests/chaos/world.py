"""The chaos suite's world: SeaweedFS (S3), Valkey, two board replicas on both, a trainer
process publishing for ever (`actor_publisher.py`) through the first and a follower
process (`deltaboard follow`) through the second, all real, all on loopback; faults
injected one after another, each followed by the invariants.

Faults (`FAULTS`), each armed on an event rather than a delay tuned to this machine: the
trainer's next acknowledged version (a line in its ack file), or a follower's journal
showing a slot being written:

- `board_kill` (either replica), `publisher_kill`, `follower_kill`: SIGKILL, then a restart;
- `board_freeze`: either replica stopped (SIGSTOP) for a random 0.5-8 s, its clients'
  requests (a commit among them) waiting, timing out and sent again meanwhile;
- `redis_flush` (FLUSHALL) and `redis_restart` (stopped, started empty);
- `redis_freeze` (SIGSTOP for a random 0.5-8 s: past the board's 5 s command timeout in
  two of five, so that a command the board gave up on may still run once the
  server wakes, its reply going nowhere);
- `s3_freeze` (SIGSTOP for a random 0.5-4 s) and `s3_restart` (SIGKILL, started again);
- `blob_corrupt`: a stored blob of the newest version gets a flipped byte; a fresh pull of
  that version must be refused, and succeed byte-exact once the blob is restored.

Invariants, after every fault (and by a watcher thread polling the board all along):
no acknowledged version lost on either replica (its manifest's state digest is the
trainer's), no replica's head ever goes back, no version visible before its manifest and
blobs are (every head the watcher sees on either has its manifest, plan and blobs), the
follower byte-exact (each tensor's sha256 is
the trainer's for the version it serves), and every error a JSON 4xx or 503, never a 500
(nor a run answered 404). Random choices come from one seeded `random.Random`: a failure
is replayed with the seed it printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import httpx

from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower.errors import DirectoryError
from deltaboard.clients.follower.journal import Journal
from deltaboard.clients.follower.verify import served
from tests.clients.support import read_dir
from tests.support.servers import (
    VENV_BIN,
    BoardServer,
    S3Server,
    ValkeyServer,
    board_server,
    seaweedfs,
    stop_process,
    wait_until,
)
from tests.support.zygote import ForkedBoard

RUN = "chaos"
FAULTS = (
    "board_kill",
    "board_freeze",
    "publisher_kill",
    "follower_kill",
    "redis_flush",
    "redis_restart",
    "redis_freeze",
    "s3_freeze",
    "s3_restart",
    "blob_corrupt",
)
ACTOR = Path(__file__).with_name("actor_publisher.py")
REPO = Path(__file__).resolve().parents[2]
EVENT_TIMEOUT_S = 60.0  # an event that should come within a second or two, on a busy machine
CONVERGE_TIMEOUT_S = 120.0


class InvariantBroken(AssertionError):
    """An invariant failed; the message names the fault, and the seed replays the run."""


@dataclass
class Watch:
    """What the watcher saw: heads in order, and every answer that broke a rule."""

    last: dict[str, int] = field(default_factory=dict)  # per replica's URL: the newest head seen
    heads: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)


def sha256_view(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256(data.tobytes()).hexdigest() for name, data in read_dir(directory).items()}


def dirty(directory: Path) -> bool:
    """Whether a follower directory shows work in progress: a slot being written or a
    blob being downloaded."""
    state = Journal(directory / ".deltaboard" / "journal.json").read()
    writing = state is not None and any(r.state == "dirty" for r in state.slots.values())
    return writing or any((directory / ".deltaboard").glob("cache/blobs/*.part"))


class World:
    def __init__(self, root: Path, seed: int) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.seed = seed
        self.counts: Counter[str] = Counter()
        self.watch = Watch()
        self._stack = contextlib.ExitStack()
        self._stop = threading.Event()
        self.acks_path = root / "acks.jsonl"
        self.acks: dict[int, dict[str, object]] = {}
        self.checked = 0  # acks verified against the board so far
        self.follower_dir = root / "follower"
        self.publisher: subprocess.Popen[bytes] | None = None
        self.follower: subprocess.Popen[bytes] | None = None
        self.fault = "start"

    # ---- the world -----------------------------------------------------------------------

    def __enter__(self) -> World:
        try:
            self.s3: S3Server = self._stack.enter_context(seaweedfs(self.root / "seaweedfs"))
            assert self.s3.process is not None and isinstance(self.s3.process.args, list)
            self.weed_args = [str(arg) for arg in self.s3.process.args]
            self.bucket = self.s3.make_bucket("chaos")
            self.valkey = ValkeyServer(self.root / "valkey").start()
            self._stack.callback(self.valkey.stop)
            settings = {**self.s3.settings(self.bucket), "redis": self.valkey.url}
            # the trainer's board and the follower's: replicas of one board (one store, one index)
            self.board: BoardServer = board_server(self.root / "board", **settings).start()
            self._stack.callback(self.board.stop)
            self.replica: BoardServer = board_server(self.root / "replica", **settings).start()
            self._stack.callback(self.replica.stop)
            self._stack.callback(self._stop_actors)
            self.start_publisher()
            self.wait_acks(1)
            self.start_follower()
            watcher = threading.Thread(target=self._watch, name="chaos-watcher", daemon=True)
            watcher.start()
            self._stack.callback(watcher.join)
            self._stack.callback(self._stop.set)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        if self.s3.process is not None:  # a restarted store is ours to stop
            stop_process(self.s3.process, timeout=2.0)

    @property
    def boards(self) -> tuple[BoardServer, BoardServer]:
        return self.board, self.replica

    def client(self, board: BoardServer | None = None) -> BoardClient:
        board = board or self.board
        return board.client(board.read_token, timeout=10.0)

    def start_publisher(self) -> None:
        log = open(self.root / "publisher.log", "ab")  # noqa: SIM115 (the child holds it)
        self.publisher = subprocess.Popen(
            [
                sys.executable,
                str(ACTOR),
                self.board.url,
                self.board.publish_token,
                RUN,
                str(self.acks_path),
                str(self.rng.randrange(2**31)),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        log.close()

    def start_follower(self) -> None:
        log = open(self.root / "follower.log", "ab")  # noqa: SIM115 (the child holds it)
        self.follower = subprocess.Popen(
            [str(VENV_BIN / "deltaboard"), "follow", "--run", RUN, "--to", str(self.follower_dir)],
            env=self.reader_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def reader_env(self) -> dict[str, str]:
        """The environment of a `deltaboard` command that reads through the follower's replica."""
        return {**os.environ, "DELTABOARD_URL": self.replica.url, "DELTABOARD_TOKEN": self.replica.read_token}

    def _stop_actors(self) -> None:
        for proc in (self.publisher, self.follower):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    def _kill(self, proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    # ---- events ------------------------------------------------------------------------

    def read_acks(self) -> int:
        """Load new ack lines; returns how many versions were acknowledged in all."""
        if self.acks_path.exists():
            for line in self.acks_path.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    self.acks[int(entry["version"])] = entry
        return len(self.acks)

    def ack_lines(self) -> int:
        return self.acks_path.read_bytes().count(b"\n") if self.acks_path.exists() else 0

    def wait_acks(self, at_least: int) -> None:
        """Until the trainer has acknowledged `at_least` versions in all (restarting it if
        it exited: a fenced or failed opening)."""
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while self.ack_lines() < at_least:
            self._revive()
            if time.monotonic() > deadline:
                raise InvariantBroken(f"{self.fault}: no new acknowledged version in {CONVERGE_TIMEOUT_S}s")
            time.sleep(0.005)

    def next_ack(self) -> None:
        """The event most faults are armed on: the trainer's next acknowledged version,
        plus a random 0-30 ms (a commit of the version after it is then in flight)."""
        self.wait_acks(self.ack_lines() + 1)
        time.sleep(self.rng.uniform(0, 0.03))

    def _revive(self) -> None:
        """Restart an actor that exited (after its kill, or on its own: counted)."""
        if self.publisher is not None and self.publisher.poll() is not None:
            self.counts["publisher_restarts"] += 1
            self.start_publisher()
        if self.follower is not None and self.follower.poll() is not None:
            self.counts["follower_restarts"] += 1
            if self.fault != "blob_corrupt" and self.follower.returncode != -signal.SIGKILL:
                tail = (self.root / "follower.log").read_text(errors="replace")[-2000:]
                self.watch.broken.append(f"{self.fault}: the follower exited by itself:\n{tail}")
            self.start_follower()

    # ---- faults ------------------------------------------------------------------------

    def inject(self, fault: str) -> None:
        self.fault = fault
        self.counts[fault] += 1
        getattr(self, fault)()

    def board_kill(self) -> None:
        self.next_ack()
        board = self.rng.choice(self.boards)
        assert board.process is not None
        board.process.send_signal(signal.SIGKILL)
        board.process.wait()
        board.process = None
        board.start()

    def board_freeze(self) -> None:
        self._freeze(self.rng.choice(self.boards).process, 8.0)

    def publisher_kill(self) -> None:
        self.next_ack()
        self._kill(self.publisher)
        self._revive()

    def follower_kill(self) -> None:
        self.next_ack()
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not dirty(self.follower_dir) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(self.rng.uniform(0, 0.002))
        self._kill(self.follower)
        self.counts["follower_kills_mid_update"] += int(dirty(self.follower_dir))
        self._revive()

    def redis_flush(self) -> None:
        self.next_ack()
        self.valkey.flushall()

    def redis_restart(self) -> None:
        self.next_ack()
        self.valkey.stop()
        time.sleep(self.rng.uniform(0, 1.0))
        self.valkey.start()

    def redis_freeze(self) -> None:
        self._freeze(self.valkey.process, 8.0)

    def s3_freeze(self) -> None:
        self._freeze(self.s3.process, 4.0)

    def _freeze(self, process: subprocess.Popen[bytes] | ForkedBoard | None, longest_s: float) -> None:
        """Stop `process` (SIGSTOP) at the trainer's next acknowledged version, for a random
        0.5 s to `longest_s`, then let it go on."""
        self.next_ack()
        assert process is not None
        process.send_signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(0.5, longest_s))
        process.send_signal(signal.SIGCONT)

    def s3_restart(self) -> None:
        self.next_ack()
        assert self.s3.process is not None
        self.s3.process.send_signal(signal.SIGKILL)
        self.s3.process.wait()
        log = self.root / "seaweedfs" / "weed.log"
        with open(log, "ab") as out:
            self.s3.process = subprocess.Popen(
                self.weed_args, stdout=out, stderr=subprocess.STDOUT, cwd=self.root / "seaweedfs"
            )
        s3 = self.s3.client()
        wait_until(lambda: bool(s3.head_bucket(Bucket=self.bucket)), "SeaweedFS", self.s3.process, log, 90)

    def blob_corrupt(self) -> None:
        """Flip a byte of a blob of the newest acknowledged version: a fresh pull of that
        version must fail, then succeed byte-exact once the blob is restored."""
        self.next_ack()
        self.read_acks()
        version = max(self.acks)
        manifest = self.client().manifest(RUN, version)
        sha = self.rng.choice(sorted(manifest.blob_shas()))
        s3 = boto3.client(
            "s3",
            endpoint_url=self.s3.endpoint,
            aws_access_key_id=self.s3.access_key,
            aws_secret_access_key=self.s3.secret_key,
            region_name=self.s3.region,
        )
        key = f"board/runs/{RUN}/blobs/{sha}"
        original = s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        at = self.rng.randrange(len(original))
        s3.put_object(
            Bucket=self.bucket,
            Key=key,
            Body=original[:at] + bytes([original[at] ^ 0xFF]) + original[at + 1 :],
        )
        try:
            with tempfile.TemporaryDirectory(dir=self.root) as fresh:
                refused = self.pull(Path(fresh), version)
                if refused.returncode == 0:
                    self.watch.broken.append(
                        f"blob_corrupt: version {version} was pulled from a corrupted blob"
                    )
                with contextlib.suppress(DirectoryError):
                    if served(Path(fresh)).version == version:
                        self.watch.broken.append(
                            f"blob_corrupt: version {version} served from a corrupted blob"
                        )
        finally:
            s3.put_object(Bucket=self.bucket, Key=key, Body=original)
        with tempfile.TemporaryDirectory(dir=self.root) as fresh:
            done = self.pull(Path(fresh), version)
            if done.returncode != 0:
                tail = done.stderr[-2000:].decode(errors="replace")
                raise InvariantBroken(f"blob_corrupt: restored version {version} not pulled: {tail}")
            self.check_exact(Path(fresh), "blob_corrupt (fresh pull)")

    def pull(self, directory: Path, version: int) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [
                str(VENV_BIN / "deltaboard"),
                "pull",
                "--run",
                RUN,
                "--to",
                str(directory),
                "--version",
                str(version),
            ],
            env=self.reader_env(),
            capture_output=True,
            timeout=CONVERGE_TIMEOUT_S,
        )

    # ---- invariants ----------------------------------------------------------------------

    def check(self) -> None:
        """After a fault: the system moves on (a new version is acknowledged and the
        follower reaches it), then every invariant holds."""
        target = self.ack_lines() + 1
        self.wait_acks(target)
        self.read_acks()
        newest = max(self.acks)
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while True:
            self._revive()
            with contextlib.suppress(DirectoryError, FileNotFoundError, ValueError):
                if served(self.follower_dir).version >= newest:
                    break
            if time.monotonic() > deadline:
                raise InvariantBroken(f"{self.fault}: the follower did not reach version {newest}")
            time.sleep(0.02)
        self.check_follower()
        self.check_acks()
        if self.watch.broken:  # each distinct finding once, in order
            raise InvariantBroken("\n".join(dict.fromkeys(self.watch.broken)))

    def check_follower(self) -> None:
        """Freeze the follower (its served slot is not written while another is current),
        compare what it serves with the trainer's view, thaw it."""
        assert self.follower is not None
        self.follower.send_signal(signal.SIGSTOP)
        try:
            self.check_exact(self.follower_dir, self.fault)
        finally:
            self.follower.send_signal(signal.SIGCONT)

    def check_exact(self, directory: Path, fault: str) -> None:
        version = served(directory).version
        self.read_acks()
        want = self.acks.get(version)
        if want is None:  # committed, but the trainer was killed before its ack: the board's word
            check = subprocess.run(
                [str(VENV_BIN / "deltaboard"), "verify", str(directory)], capture_output=True, timeout=60
            )
            if check.returncode != 0:
                tail = check.stdout[-2000:].decode(errors="replace")
                raise InvariantBroken(f"{fault}: version {version} is not byte-exact: {tail}")
            return
        if sha256_view(directory) != want["sha256"]:
            raise InvariantBroken(
                f"{fault}: the follower serves version {version} with other bytes than published"
            )
        self.counts["exact_checks"] += 1

    def check_acks(self) -> None:
        """Every version acknowledged since the last check, and a few older ones, is on
        both replicas with the trainer's state digest."""
        versions = sorted(self.acks)
        fresh, older = versions[self.checked :], versions[: self.checked]
        sample = fresh + self.rng.sample(older, min(5, len(older)))
        self.verify_acks(sample)
        self.checked = len(versions)

    def verify_acks(self, versions: list[int]) -> None:
        for board in self.boards:
            client = self.client(board)
            for version in versions:
                found = client.manifest(RUN, version)
                if found.state_digest != self.acks[version]["state_digest"]:
                    raise InvariantBroken(
                        f"{self.fault}: acknowledged version {version} was replaced ({board.url})"
                    )
        self.counts["acks_verified"] += len(versions)

    def final_check(self) -> None:
        """At the end: every acknowledged version, and both replicas' logs free of 500s."""
        self.read_acks()
        self.verify_acks(sorted(self.acks))
        for board in self.boards:
            for log in board.data_dir.glob("board-*.log"):
                if "unhandled error" in log.read_text(errors="replace"):
                    raise InvariantBroken(f"the board answered 500 (see {log})")

    # ---- the watcher -----------------------------------------------------------------------

    def _watch(self) -> None:
        with contextlib.ExitStack() as clients:
            https = [
                (board, clients.enter_context(httpx.Client(headers=_reader(board), timeout=10.0)))
                for board in self.boards
            ]
            while not self._stop.wait(0.02):
                for board, http in https:  # each replica in turn
                    with contextlib.suppress(httpx.TransportError):
                        self._look(board, http)

    def _look(self, board: BoardServer, http: httpx.Client) -> None:
        url = f"{board.url}/v1/runs/{RUN}"
        answer = http.get(f"{url}/head")
        if not self._acceptable(answer, "head"):
            return
        version = answer.json()["version"]
        watch, last = self.watch, self.watch.last.get(board.url)
        if last is not None and (version is None or version < last):
            watch.broken.append(f"{self.fault}: head went back from {last} to {version} on {board.url}")
            return
        if version is None or version == last:
            return
        watch.last[board.url] = version
        watch.heads += 1
        for path in (f"/manifests/{version}", f"/plan?to={version}"):
            answer = http.get(url + path)
            if not self._acceptable(answer, path) or answer.status_code != 200:
                return
        for step in answer.json()["steps"]:
            for blob in step["blobs"]:
                found = http.head(f"{url}/blobs/{blob['sha256']}")
                self._acceptable(found, "blob")

    def _acceptable(self, answer: httpx.Response, what: str) -> bool:
        """Count the answer; note it if it breaks the error rules. Returns whether it is a 200."""
        self.watch.answers[str(answer.status_code)] += 1
        if answer.status_code < 400:
            return answer.status_code == 200
        try:
            if answer.request.method == "HEAD":  # no body: the headers must say JSON
                code = "?" if answer.headers.get("content-type") == "application/json" else None
            else:
                code = answer.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if (answer.status_code >= 500 and answer.status_code != 503) or code is None:
            self.watch.broken.append(
                f"{self.fault}: {what} answered {answer.status_code}: {answer.text[:300]}"
            )
        elif answer.status_code == 404:
            self.watch.broken.append(f"{self.fault}: {what} answered 404 {code} for a committed version")
        return False


def _reader(board: BoardServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {board.read_token}"}


def run_chaos(root: Path, seed: int, faults: int, report: Callable[[str], None]) -> Counter[str]:
    """`faults` faults drawn from `FAULTS` (each kind once first, in a seeded order), each
    followed by the invariants; returns the counts."""
    report(f"chaos: seed {seed}, {faults} faults (replay: DELTABOARD_CHAOS_SEED={seed})")
    with World(root, seed) as world:
        kinds = list(FAULTS)
        world.rng.shuffle(kinds)
        plan = (kinds + [world.rng.choice(FAULTS) for _ in range(max(0, faults - len(kinds)))])[:faults]
        started = time.monotonic()
        for i, fault in enumerate(plan, 1):
            world.inject(fault)
            world.check()
            if i % 10 == 0 or i == len(plan):
                report(
                    f"  {i}/{len(plan)} faults, {len(world.acks)} versions acknowledged, "
                    f"{time.monotonic() - started:.0f}s"
                )
        world.final_check()
        counts = Counter(world.counts)
        counts["versions_acknowledged"] = len(world.acks)
        counts["heads_watched"] = world.watch.heads
        for status, n in world.watch.answers.items():
            counts[f"answers_{status}"] = n
    report("chaos: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return counts


def chaos_seed() -> int:
    """DELTABOARD_CHAOS_SEED, or a fresh one (printed, so that a failure can be replayed)."""
    return int(os.environ.get("DELTABOARD_CHAOS_SEED") or secrets.randbelow(2**31))


@contextlib.contextmanager
def chaos_root(base: Path | None = None) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="deltaboard-chaos-", dir=base) as tmp:
        yield Path(tmp)
