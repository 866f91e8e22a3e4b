"""`Follower`: a local Hugging Face checkpoint kept at an exact version of a run.

    follower = Follower(board, "run-1", Path("/models/policy"), node_id="node-7")
    follower.sync()                       # bootstrap or catch up to head, once
    follower.follow(stop_event)           # long-poll head and keep up until stopped

One update (`sync`) goes:

1. plan: the board's cheapest chain from the served version to the target (a keyframe
   plus deltas for an empty or pruned node); steps before the chain's last keyframe are
   dropped, since a keyframe replaces everything;
2. fetch: the chain's manifests and blobs into the local cache, in parallel, resumable,
   sha256-checked (`fetch`);
3. stage: the other slot (`slots`) is brought to the served version (replaying the cached
   deltas it missed, or copying the served slot when those are gone), then the chain is
   applied in place (`apply`), each tensor verified in O(changed elements) and the whole
   state digest checked per version. The journal marks the slot dirty during the writes
   and clean at the new version after them (`journal`);
4. commit: `commit_hook(version, swap)` lets an engine drain or pause, `swap()` flips the
   `current` link (atomic rename), the engine reloads and resumes; then the cache is
   pruned, a heartbeat tells the board's fleet table, and `on_version` is called.

A blob that fails to decode or verify is discarded and refetched once; a second failure
raises `IntegrityError`. Until the swap nothing touches the served slot, so any failure
(or a kill) leaves the served version intact, and a restart resumes from the journal.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx

from board.errors import BoardError
from board.schemas import Heartbeat, Manifest, Plan
from board.view_spec import INDEX_FILE
from clients.board_client import BoardClient
from clients.follower.apply import BadBlob, apply_step
from clients.follower.errors import FollowerError, IntegrityError
from clients.follower.fetch import BlobCache, BlobReader, Fetcher
from clients.follower.journal import Journal, SlotName, SlotRecord
from clients.follower.layout import materialize
from clients.follower.manifests import ManifestCache
from clients.follower.patcher import ShardMaps
from clients.follower.slots import Slots, other

log = logging.getLogger("deltaboard.follower")

CommitHook = Callable[[int, Callable[[], None]], None]


class Progress(Protocol):
    """Receives progress of an update: phase "fetch" counts bytes, "apply" tensors, "copy"
    slots (a full local copy, only after a bootstrap, a keyframe or a crash)."""

    def start(self, phase: str, total: int) -> None: ...

    def advance(self, phase: str, n: int) -> None: ...


def swap_now(version: int, swap: Callable[[], None]) -> None:
    """The default commit hook: no engine to coordinate with, just make it current."""
    swap()


class Follower:
    """Keeps `directory` at a version of `run` (see the module docstring for the steps)."""

    def __init__(
        self,
        board: BoardClient,
        run: str,
        directory: Path,
        *,
        node_id: str,
        engine: str = "",
        commit_hook: CommitHook | None = None,
        on_version: Callable[[int], None] | None = None,
        progress: Progress | None = None,
        workers: int = 4,
        poll_s: float = 5.0,
        heartbeat_s: float = 10.0,
    ) -> None:
        self.board = board
        self.run = run
        self.node_id = node_id
        self.engine = engine
        self._commit_hook = commit_hook or swap_now
        self._on_version = on_version
        self._progress = progress
        self._poll_s = poll_s
        self._heartbeat_s = heartbeat_s
        self._last_beat = 0.0
        self._lock = threading.RLock()
        self._slots = Slots(Path(directory))
        self._slots.open()
        self._journal = Journal(self._slots.journal_path)
        self._state = self._journal.load(run)
        self._blobs = BlobCache(self._slots.blob_dir)
        self._fetcher = Fetcher(board, run, self._blobs, workers=workers)
        self._manifests = ManifestCache(self._slots.manifest_dir, run)

    # ---- public API ------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The served version (None before the first one)."""
        current = self._slots.current()
        return None if current is None else self._state.slot(current).version

    @property
    def model_dir(self) -> Path:
        """The stable path an engine loads: its entries link through `current` to the served slot."""
        return self._slots.root

    def close(self) -> None:
        """Release the directory (its lock); the directory itself stays as it is."""
        self._slots.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync(self, version: int | None = None) -> int:
        """Reach `version` (default: head) and return the version served afterwards."""
        with self._lock:
            target = self._resolve(version)
            if self.version != target:
                refetched: set[str] = set()
                while True:
                    try:
                        staged = self._stage(target)
                        break
                    except BadBlob as exc:
                        if exc.sha in refetched:
                            raise IntegrityError(f"{exc} (again after a refetch)") from exc
                        log.warning("discarding and refetching: %s", exc)
                        refetched.add(exc.sha)
                        self._fetcher.refetch(exc.sha, self._bytes_progress())
                self._commit(staged, target)
            self._heartbeat()
            return target

    def follow(self, stop: threading.Event) -> None:
        """Long-poll head and sync each new version until `stop` is set.

        Board or network trouble is logged and retried with backoff; an `IntegrityError`
        (data that verified wrong twice) is raised, since retrying cannot fix it.
        """
        failures = 0
        while not stop.is_set():
            try:
                held = self.version
                head = self.board.head(self.run, after=-1 if held is None else held, wait=self._poll_s)
                if head.version is not None and head.version != held:
                    self.sync(head.version)
                elif time.monotonic() - self._last_beat >= self._heartbeat_s:
                    self._heartbeat()
                failures = 0
            except IntegrityError:
                raise
            except (BoardError, FollowerError, httpx.HTTPError, OSError) as exc:
                failures += 1
                delay = min(0.5 * 2**failures, 30.0)
                log.warning("follow: %s; retrying in %.1fs", exc, delay)
                stop.wait(delay)

    # ---- planning and fetching -------------------------------------------------------

    def _resolve(self, version: int | None) -> int:
        if version is not None:
            return version
        head = self.board.head(self.run).version
        if head is None:
            raise FollowerError(f"run {self.run!r} has no committed version yet")
        return head

    def _plan(self, held: int | None, target: int) -> Plan:
        try:
            return self.board.plan(self.run, held, target)
        except BoardError as exc:
            if exc.code != "UnknownBase":
                raise
            log.info("version %s is pruned on the board: bootstrapping from a keyframe", held)
            return self.board.plan(self.run, None, target)

    def _chain(self, held: int | None, target: int) -> list[Manifest]:
        """The manifests to apply on top of `held`, from the last keyframe if there is one."""
        plan = self._plan(held, target)
        steps = list(plan.steps)
        fulls = [i for i, s in enumerate(steps) if s.kind == "full"]
        if fulls:
            steps = steps[fulls[-1] :]
        if not steps or steps[-1].version != target:
            raise FollowerError(f"the board's plan {held}->{target} does not end at {target}")
        missing = self._fetcher.missing(b for s in steps for b in s.blobs)
        self._open_phase("fetch", sum(b.size for b in missing))
        self._fetcher.fetch(missing, self._bytes_progress())
        return [self._manifests.get(self.board, s.version) for s in steps]

    def _replayable(self, record: SlotRecord, held: int | None) -> list[Manifest] | None:
        """Cached deltas taking a slot at `record` to `held`, or None if any is missing."""
        if record.state != "clean" or record.version is None or held is None or record.version > held:
            return None
        chain = [self._manifests.cached(v) for v in range(record.version + 1, held + 1)]
        if any(
            m is None or m.kind != "delta" or not all(self._blobs.has(s) for s in m.blob_shas())
            for m in chain
        ):
            return None
        return [m for m in chain if m is not None]

    def _assets(self) -> dict[str, bytes]:
        """The run's assets, except names that would shadow the weight files."""
        names = [
            n
            for n in self.board.get_run(self.run).assets
            if not n.endswith(".safetensors") and n != INDEX_FILE
        ]
        return {n: self.board.get_asset(self.run, n) for n in names}

    # ---- staging ---------------------------------------------------------------------

    def _save(self, slot: SlotName, record: SlotRecord) -> None:
        self._state = self._state.with_slot(slot, record)
        self._journal.save(self._state)

    def _stage(self, target: int) -> SlotName:
        """Bring the non-served slot to `target`, verified; returns it."""
        current = self._slots.current()
        staging: SlotName = "A" if current is None else other(current)
        held = self.version
        record = self._state.slot(staging)
        if record.state == "clean" and record.version == target:
            return staging  # staged before an interrupted commit
        chain = self._chain(held, target)
        fresh = chain[0].kind == "full"
        replay = [] if fresh else self._replayable(record, held)
        base = dict(record.digests)
        assets = self._assets() if fresh else {}

        self._save(staging, SlotRecord(state="dirty"))
        if replay is None:
            assert current is not None  # a delta chain starts from a served version
            self._open_phase("copy", 1)
            self._slots.copy(current, staging)
            self._advance("copy", 1)
            base = dict(self._state.slot(current).digests)
            replay = []
        digests = self._apply(staging, replay + chain, base, assets)
        self._save(
            staging,
            SlotRecord(state="clean", version=target, digests=digests, state_digest=chain[-1].state_digest),
        )
        return staging

    def _apply(
        self, slot: SlotName, chain: list[Manifest], digests: dict[str, str], assets: dict[str, bytes]
    ) -> dict[str, str]:
        """Apply `chain` to a slot whose tensor digests are `digests` (a keyframe in the
        chain starts the slot over); returns the digests at the chain's end."""
        slot_dir = self._slots.slot_dir(slot)
        self._open_phase("apply", sum(len(m.tensors) for m in chain))
        maps: ShardMaps | None = None
        try:
            with BlobReader(self._blobs) as reader:
                for manifest in chain:
                    if manifest.kind == "full":
                        if maps is not None:
                            maps.close()
                        self._slots.reset(slot)
                        materialize(slot_dir, manifest, assets)
                        maps, digests = None, {}
                    if maps is None:
                        maps = ShardMaps(slot_dir, writable=True)
                    apply_step(maps, manifest, reader, digests, lambda n: self._advance("apply", n))
            if maps is not None:
                maps.flush()
        finally:
            if maps is not None:
                maps.close()
        return digests

    # ---- commit ----------------------------------------------------------------------

    def _commit(self, staged: SlotName, version: int) -> None:
        held = self.version

        def swap() -> None:
            if self._slots.current() != staged:
                self._slots.swap(staged)

        self._commit_hook(version, swap)
        if self._slots.current() != staged:
            raise FollowerError(f"the commit hook returned without calling swap() for version {version}")
        log.info("serving version %d (was %s)", version, held)
        self._prune(staged, other(staged))
        if self._on_version is not None:
            self._on_version(version)

    def _prune(self, served: SlotName, stale: SlotName) -> None:
        """Keep the served version's manifest and what the stale slot needs to catch up."""
        version = self._state.slot(served).version
        assert version is not None
        replay = self._replayable(self._state.slot(stale), version) or []
        self._manifests.keep_only({version} | {m.version for m in replay})
        self._blobs.keep_only({sha for m in replay for sha in m.blob_shas()})

    def _heartbeat(self) -> None:
        """Tell the board's fleet table which version this node serves (best effort)."""
        beat = Heartbeat(
            node_id=self.node_id, version=self.version, engine=self.engine, meta={"pid": os.getpid()}
        )
        try:
            self.board.heartbeat(self.run, beat)
            self._last_beat = time.monotonic()
        except (BoardError, httpx.HTTPError) as exc:
            log.warning("heartbeat failed: %s", exc)

    # ---- progress --------------------------------------------------------------------

    def _open_phase(self, phase: str, total: int) -> None:
        if self._progress is not None:
            self._progress.start(phase, total)

    def _advance(self, phase: str, n: int) -> None:
        if self._progress is not None:
            self._progress.advance(phase, n)

    def _bytes_progress(self) -> Callable[[int], None] | None:
        return None if self._progress is None else (lambda n: self._advance("fetch", n))
