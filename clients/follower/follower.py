"""`Follower`: a local Hugging Face checkpoint kept at an exact version of a run.

    follower = Follower(board, "run-1", Path("/models/policy"), node_id="node-7")
    follower.sync()                       # bootstrap or catch up to head, once
    follower.follow(stop_event)           # long-poll head and keep up until stopped

One update (`sync`) goes:

1. plan: the board's cheapest chain from the served version to the target (a keyframe
   plus deltas for an empty or pruned node); steps before the chain's last keyframe are
   dropped, since a keyframe replaces everything;
2. fetch: the chain's manifests and blobs into the local cache, in parallel, resumable,
   sha256-checked (`fetch`). The blobs of derived steps (a worker keyframe, a span) are
   not cached: their tensors' ranges are fetched in parallel during the apply, each
   checked and decoded as it arrives (`fetch.RangedReader`), so a catch-up decodes while
   it downloads;
3. stage: the chain is applied in place to the other slot (`slots`), which already holds
   the served version (see 5), each tensor verified in O(changed elements) before it is
   written and the state digest checked per version (`apply`). The journal marks the slot
   dirty during the writes and clean at the new version after them (`journal`);
4. check: when the changes just written will be replayed into the served slot (step 6),
   that slot's bits at the changed positions must be the changes' old bits (O(changes),
   read-only); if they are not, the served slot is damaged and the update stops with
   `CorruptBase` before anything is committed;
5. commit: `commit_hook(version, swap)` lets an engine drain or pause, `swap()` flips the
   `current` link (atomic rename), the engine reloads and resumes; `on_version` is called;
6. mirror: the slot that was served until now is brought to the same version, by
   replaying the changes just written (kept in memory, at most `mirror_budget_bytes`)
   or, after a keyframe, a long catch-up or a crash, by a local copy; then the cache is
   pruned and a heartbeat tells the board's fleet table.

A blob that fails to decode or verify is discarded and refetched once; a second failure
raises `IntegrityError`. A slot whose bytes are not what its journal records (bit rot, an
outside write) is refused with `CorruptBase` wherever an update reads it as a base (steps
3 and 4); those checks cost O(changes), so damage at positions no update touches is found
only by a full re-hash: `deltaboard verify`, or `repair()`, which also rebuilds it.

Until the swap nothing touches the served slot, so any failure (or a kill) leaves the
served version intact, and a restart resumes from the journal (blobs already downloaded
stay in the cache; a dirty slot is copied from the served one).

Durability: a killed process loses nothing that reached the page cache, so kill -9 at
any instant is safe by default (renames are atomic; nothing is fsynced). `durable=True`
also survives power loss: each slot's files are fsynced before the journal marks it
clean, and the journal and the `current` link are fsynced; it costs the write-back of
every dirty page, which with changes spread over a tensor is about the whole file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import httpx

from deltaboard.board.contract.errors import AuthError, BoardError, UnknownBase, UnknownRun
from deltaboard.board.contract.schemas import Heartbeat, Manifest, Plan
from deltaboard.board.contract.view_spec import INDEX_FILE
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower.apply import BadBlob, Written, apply_step, check_base, replay
from deltaboard.clients.follower.errors import (
    CorruptBase,
    DirectoryError,
    FollowerError,
    IntegrityError,
    UnusableManifest,
)
from deltaboard.clients.follower.fetch import BlobCache, BlobReader, Fetcher, PatchSource, RangedReader
from deltaboard.clients.follower.journal import Journal, SlotName, SlotRecord
from deltaboard.clients.follower.layout import materialize
from deltaboard.clients.follower.manifests import ManifestCache
from deltaboard.clients.follower.patcher import ShardMaps
from deltaboard.clients.follower.slots import CURRENT, SLOT_NAMES, Slots, other
from deltaboard.clients.follower.spans import as_delta, as_full
from deltaboard.clients.follower.verify import damaged, hash_tensors
from deltaboard.clients.resident import HotPatch, prepare_patch

log = logging.getLogger("deltaboard.follower")

# Memory a kept change costs: its int64 position plus old and new bits (up to 8 bytes each
# for the widest dtype; 12 for bf16). Bounded by `mirror_budget_bytes`.
CHANGE_BYTES = 24
# Tensors decoded and written at once: numpy and zstd release the GIL, so one per core.
APPLY_THREADS = max(1, min(4, os.cpu_count() or 1))
# Tensors of a derived step (a worker keyframe, a span) downloaded by ranges, decoded and
# written at once: at least four, so that downloads overlap decoding even on few cores, and
# up to one per core, since decoding bounds them (a span carries up to 32 versions'
# changes) where a delta's apply is bound by page faults (`APPLY_THREADS`).
RANGED_THREADS = max(4, min(16, os.cpu_count() or 1))

CommitHook = Callable[[int, Callable[[], None]], None]


class Progress(Protocol):
    """Receives progress of an update: phase "fetch" counts bytes, "apply" tensors, "mirror"
    and "copy" slots (a copy only after a bootstrap, a keyframe, a long catch-up or a crash),
    "verify" the bytes `repair` re-hashes."""

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
        durable: bool = False,
        mirror_budget_bytes: int = 512 * 2**20,
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
        self._durable = durable
        self._mirror_budget = mirror_budget_bytes
        self._lock = threading.RLock()
        self._slots = Slots(Path(directory), durable=durable)
        self._slots.open()
        self._slots.refresh_links()
        self._journal = Journal(self._slots.journal_path, durable=durable)
        try:
            self._state = self._journal.load(run)
        except DirectoryError:
            self._slots.close()
            raise
        self._pool = ThreadPoolExecutor(APPLY_THREADS, thread_name_prefix="deltaboard-apply")
        self._maps: dict[SlotName, ShardMaps] = {}
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
        for slot in list(self._maps):
            self._unmap(slot)
        self._pool.shutdown()
        self._slots.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync(self, version: int | None = None) -> int:
        """Reach `version` (default: head) and return the version served afterwards."""
        with self._lock:
            target = self._resolve(version)
            held = self.version
            if held != target:
                staged, written = self._stage_verified(target)
                self._check_mirror_base(staged, held, written)
                self._commit(staged, target)
                self._mirror(staged, held, written)
                self._prune()
            self._heartbeat()
            return target

    def follow(self, stop: threading.Event, run_wait_s: float = 0.0) -> None:
        """Long-poll head and sync each new version until `stop` is set.

        Board or network trouble is logged and retried with backoff. What retrying cannot
        fix is raised: `IntegrityError` (data that verified wrong twice), `CorruptBase` (a
        damaged slot: run `repair`), `UnusableManifest` (a manifest that breaks the
        contract), `Unauthorized` / `Forbidden` (the token), and
        `UnknownRun`, at once when the run existed (this directory holds a version of it,
        or its head was seen) and otherwise after waiting `run_wait_s` for it to appear.
        """
        failures = 0
        existed = self.version is not None
        give_up = time.monotonic() + run_wait_s
        while not stop.is_set():
            try:
                held = self.version
                head = self.board.head(self.run, after=-1 if held is None else held, wait=self._poll_s)
                existed = True
                if head.version is not None and head.version != held:
                    self.sync(head.version)
                elif time.monotonic() - self._last_beat >= self._heartbeat_s:
                    self._heartbeat()
                failures = 0
            except (IntegrityError, CorruptBase, UnusableManifest, AuthError):
                raise
            except UnknownRun:
                if existed or time.monotonic() >= give_up:
                    raise
                stop.wait(min(self._poll_s, max(0.0, give_up - time.monotonic())))
            except (BoardError, FollowerError, httpx.HTTPError, OSError, ValueError) as exc:
                failures += 1
                delay = min(0.5 * 2**failures, 30.0)
                log.warning("follow: %s; retrying in %.1fs", exc, delay)
                stop.wait(delay)

    def repair(self, version: int | None = None) -> dict[SlotName, list[str]]:
        """Re-hash both slots against the journal and rebuild whatever is damaged.

        Reads every byte of both slots (O(model)); returns the damaged tensors by slot. A
        damaged slot is marked dirty at once, so that nothing trusts it again. A damaged
        slot that is not served is rebuilt as a copy of the served one. A damaged served
        slot is never patched in place: `version` (default: the version it served) is
        staged in the other slot (as is when that slot holds it intact, else from a
        keyframe and deltas fetched from the board), committed through the commit hook like
        any update, and the damaged slot becomes a copy of it.
        """
        with self._lock:
            before = self.version
            damage: dict[SlotName, list[str]] = {}
            for slot in SLOT_NAMES:
                bad = self._damaged(slot)
                if bad:
                    damage[slot] = bad
                    self._save(slot, SlotRecord(state="dirty"))
            current = self._slots.current()
            target = before if version is None else version
            if current in damage and target is not None:
                staged, _ = self._stage_verified(target)
                self._commit(staged, target)
                self._mirror(staged, None, None)
                self._prune()
            elif current is not None and self._state.slot(other(current)).state == "dirty":
                self._mirror(current, None, None)
            return damage

    def fetch(self, target: int) -> None:
        """Download what reaching `target` from the served version needs into the cache
        (verified by sha256; a later `sync` or `hot_patch` finds it there), except a worker
        keyframe's ranges, which the apply fetches as it decodes them."""
        with self._lock:
            self._chain(self.version, target, cache_spans=True)

    def hot_patch(self, target: int) -> HotPatch:
        """The verified changes from the served version to `target`, for a resident view.

        `target` must be one delta after the served version (a resident view takes versions
        one at a time; a keyframe or a pruned base is a reload). The blobs are fetched into
        the cache, where the next `sync(target)` (the disk copy) finds them, and each patch
        is decoded against the served slot, which holds the bits the engine serves, and
        verified against the held and the manifest's digests. Nothing is written.
        """
        with self._lock:
            held, current = self.version, self._slots.current()
            if held is None or current is None:
                raise FollowerError("nothing is served yet: a resident view starts from a loaded version")
            chain, _ = self._chain(held, target, cache_spans=True)
            if len(chain) != 1 or chain[0].kind != "delta" or chain[0].parent != held:
                raise FollowerError(f"version {target} is not one delta after {held}: reload it instead")
            digests = self._state.slot(current).digests
            maps = self._mapped(current)
            # Decoding is all of the engine's wait once the blobs are here: every core, not
            # the few the disk apply uses (that one is bound by page faults, this one is not).
            with (
                BlobReader(self._blobs) as reader,
                ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="deltaboard-decode") as pool,
            ):
                return prepare_patch(chain[0], reader.read, maps.tensor, digests, pool)

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
        except UnknownBase:
            log.info("version %s is pruned on the board: bootstrapping from a keyframe", held)
            return self.board.plan(self.run, None, target)

    def _chain(
        self, held: int | None, target: int, *, cache_spans: bool = False
    ) -> tuple[list[Manifest], set[int]]:
        """The manifests to apply on top of `held`, from the last keyframe if there is one,
        and the indices of those whose patches the apply reads by ranges (`RangedReader`):
        a worker keyframe the chain starts with, and spans whose blobs are not in the cache,
        unless `cache_spans` downloads them first (for `fetch` ahead, and `hot_patch`)."""
        plan = self._plan(held, target)
        steps = list(plan.steps)
        fulls = [i for i, s in enumerate(steps) if s.kind in ("full", "keyframe")]
        if fulls:
            steps = steps[fulls[-1] :]
        if not steps or steps[-1].version != target:
            raise FollowerError(f"the board's plan {held}->{target} does not end at {target}")
        by_ranges = {
            i
            for i, s in enumerate(steps)
            if s.kind == "keyframe"
            or (s.kind == "span" and not cache_spans and self._fetcher.missing(s.blobs))
        }
        missing = self._fetcher.missing(b for i, s in enumerate(steps) if i not in by_ranges for b in s.blobs)
        self._open_phase(
            "fetch", sum(b.size for b in missing) + sum(b.size for i in by_ranges for b in steps[i].blobs)
        )
        self._fetcher.fetch(missing, self._bytes_progress())
        chain: list[Manifest] = []
        for s in steps:
            manifest = self._manifests.get(self.board, s.version)
            if s.kind == "keyframe":
                manifest = as_full(self.board.keyframe(self.run, s.version), manifest)
            if s.kind == "span":
                base = chain[-1].version if chain else held
                if base is None:
                    raise FollowerError(f"the board's plan reaches {s.version} by a span from nothing")
                manifest = as_delta(self.board.span(self.run, base, s.version), manifest, base)
            chain.append(manifest)
        return chain, by_ranges

    def _assets(self) -> dict[str, bytes]:
        """The run's assets, except names that would shadow the weight files or `current`."""
        names = [
            n
            for n in self.board.get_run(self.run).assets
            if not n.endswith(".safetensors") and n != INDEX_FILE and n.split("/")[0] != CURRENT
        ]
        return {n: self.board.get_asset(self.run, n) for n in names}

    # ---- staging ---------------------------------------------------------------------

    def _save(self, slot: SlotName, record: SlotRecord) -> None:
        self._state = self._state.with_slot(slot, record)
        self._journal.save(self._state)

    def _stage_verified(self, target: int) -> tuple[SlotName, list[Written] | None]:
        """`_stage`, discarding and refetching (once each) blobs that fail to verify."""
        refetched: set[str] = set()
        while True:
            try:
                return self._stage(target)
            except BadBlob as exc:
                if exc.sha in refetched:
                    raise IntegrityError(f"{exc} (again after a refetch)") from exc
                log.warning("discarding and refetching: %s", exc)
                refetched.add(exc.sha)
                self._fetcher.refetch(exc.sha, self._bytes_progress())

    def _stage(self, target: int) -> tuple[SlotName, list[Written] | None]:
        """Bring the non-served slot to `target`, verified. Returns it, and the changes
        written when they can bring the other slot forward too (None: copy it instead)."""
        current = self._slots.current()
        staging: SlotName = "A" if current is None else other(current)
        held = self.version
        record = self._state.slot(staging)
        if record.state == "clean" and record.version == target:
            return staging, None  # staged before an interrupted commit
        chain, by_ranges = self._chain(held, target)
        fresh = chain[0].kind == "full"
        assets = self._assets() if fresh else {}
        changed = sum(m.stats.changed_elements for m in chain)
        keep = not fresh and changed * CHANGE_BYTES <= self._mirror_budget
        written: list[Written] | None = [] if keep else None

        self._save(staging, SlotRecord(state="dirty"))
        base = record.digests
        if not fresh and (record.state != "clean" or record.version != held):
            if current is None:
                raise FollowerError(f"the board's plan to {target} starts with a delta but nothing is served")
            self._copy(current, staging)
            base = self._state.slot(current).digests
        digests = self._apply(staging, chain, dict(base), assets, written, by_ranges)
        self._make_durable(staging)
        self._save(staging, SlotRecord(state="clean", version=target, digests=digests))
        return staging, written

    def _damaged(self, slot: SlotName) -> list[str]:
        """The tensors of a clean slot that do not hash to their recorded digests (all of
        them when its files cannot be read); nothing for a slot that is not clean."""
        record = self._state.slot(slot)
        if record.state != "clean":
            return []
        try:
            maps = ShardMaps(self._slots.slot_dir(slot), writable=False)
            self._open_phase("verify", sum(p.nbytes for p in maps.placements.values()))
            try:
                return damaged(record, hash_tensors(maps, lambda n: self._advance("verify", n)))
            finally:
                maps.close()
        except (OSError, ValueError):
            return sorted(record.digests)

    def _mapped(self, slot: SlotName) -> ShardMaps:
        """The slot's shard files, mapped writable. Mappings are kept from one update to the
        next: the pages stay mapped, so the next patch takes fewer faults."""
        maps = self._maps.get(slot)
        if maps is None:
            maps = self._maps[slot] = ShardMaps(self._slots.slot_dir(slot), writable=True)
        return maps

    def _unmap(self, slot: SlotName) -> None:
        """Forget a slot's mappings before its files are replaced."""
        maps = self._maps.pop(slot, None)
        if maps is not None:
            maps.close()

    def _copy(self, src: SlotName, dst: SlotName) -> None:
        self._open_phase("copy", 1)
        self._unmap(dst)
        self._slots.copy(src, dst)
        self._advance("copy", 1)

    def _apply(
        self,
        slot: SlotName,
        chain: list[Manifest],
        digests: dict[str, str],
        assets: dict[str, bytes],
        written: list[Written] | None,
        by_ranges: set[int],
    ) -> dict[str, str]:
        """Apply `chain` to a slot whose tensor digests are `digests` (a keyframe in the
        chain starts the slot over); returns the digests at the chain's end. The steps at
        `by_ranges` (derived data not in the cache) are read by ranges on `RANGED_THREADS`,
        the others from the cache on `APPLY_THREADS`."""
        slot_dir = self._slots.slot_dir(slot)
        self._open_phase("apply", sum(len(m.tensors) for m in chain))
        with BlobReader(self._blobs) as cached, ThreadPoolExecutor(RANGED_THREADS) as wide:
            for i, manifest in enumerate(chain):
                if manifest.kind == "full":
                    self._unmap(slot)
                    self._slots.reset(slot)
                    materialize(slot_dir, manifest, assets)
                    digests = {}
                reader: PatchSource = cached
                pool: Executor = self._pool
                ranges = None
                if i in by_ranges:
                    ranges = RangedReader(self.board, self.run, manifest.tensors, self._bytes_progress())
                    reader, pool = ranges, wide
                try:
                    apply_step(
                        self._mapped(slot),
                        manifest,
                        reader,
                        digests,
                        pool,
                        progress=lambda n: self._advance("apply", n),
                        written=written,
                    )
                finally:
                    if ranges is not None:
                        ranges.close()
        return digests

    # ---- commit and mirror -----------------------------------------------------------

    def _commit(self, staged: SlotName, version: int) -> None:
        held = self.version

        def swap() -> None:
            if self._slots.current() != staged:
                self._slots.swap(staged)

        self._commit_hook(version, swap)
        if self._slots.current() != staged:
            raise FollowerError(f"the commit hook returned without calling swap() for version {version}")
        log.info("serving version %d (was %s)", version, held)
        if self._on_version is not None:
            self._on_version(version)

    def _check_mirror_base(self, staged: SlotName, base: int | None, written: list[Written] | None) -> None:
        """Before committing, check that the served slot holds `base` where the changes that
        `_mirror` will replay into it land (skipped when it will be copied instead)."""
        stale = other(staged)
        record = self._state.slot(stale)
        if written is None or record.state != "clean" or record.version != base:
            return
        bad = check_base(self._mapped(stale), written, self._pool)
        if bad:
            raise CorruptBase(
                f"the served slot {stale} does not hold version {base} at tensor(s) "
                f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}: it is damaged",
                bad,
            )

    def _mirror(self, served: SlotName, base: int | None, written: list[Written] | None) -> None:
        """Bring the slot that was served (at `base`) to the served version, so that the
        next update stages on top of it: by replaying the changes just written when they
        were kept, else by a local copy."""
        stale = other(served)
        record, now = self._state.slot(stale), self._state.slot(served)
        if record.state == "clean" and record.version == now.version:
            return
        self._save(stale, SlotRecord(state="dirty"))
        if written is not None and record.state == "clean" and record.version == base:
            self._open_phase("mirror", 1)
            replay(self._mapped(stale), written, self._pool)  # its base checked before the commit
            self._advance("mirror", 1)
        else:
            self._copy(served, stale)
        self._make_durable(stale)
        self._save(stale, now)

    def _make_durable(self, slot: SlotName) -> None:
        """With `durable`, flush a slot's files to disk before the journal calls it clean."""
        if self._durable:
            self._slots.fsync(slot)

    def _prune(self) -> None:
        """Keep only the served version's manifest (for `verify`); the blobs are applied."""
        version = self.version
        self._manifests.keep_only(set() if version is None else {version})
        self._blobs.keep_only(set())

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
