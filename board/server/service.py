"""The board's use cases, called by the routes: each one coordinates the ledger (the
durable truth in the object store, run in worker threads) and the index (the cache and
the long-polls' wake-ups) in the order that keeps the two consistent, and reads time from
the one injected clock (`board.server.clock`).

The routes only parse, authorise, call this and shape the answer; nothing here knows
HTTP. Failures are the contract's typed errors (`board.contract.errors`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread

from deltaboard.board.contract.errors import (
    BodyTooLarge,
    DigestMismatch,
    IndexUnavailable,
    NoChain,
    NotFound,
    UnknownAsset,
    UnknownBlob,
    UnknownRun,
    UnknownVersion,
)
from deltaboard.board.contract.schemas import (
    BlobUploadTarget,
    FleetNode,
    Head,
    Heartbeat,
    Lease,
    LeaseRenew,
    LeaseRequest,
    Manifest,
    Plan,
    Prepared,
    RetentionPolicy,
    RetentionReport,
    RunCreate,
    RunInfo,
    VersionSummary,
)
from deltaboard.board.server import plan as planning
from deltaboard.board.server.clock import Clock
from deltaboard.board.server.index import Index
from deltaboard.board.server.ledger import Ledger
from deltaboard.board.server.metrics import BoardMetrics
from deltaboard.board.server.prepared import PreparedManifest, PreparedManifests
from deltaboard.board.server.records import RunRecord, head_rank, served_manifest
from deltaboard.board.server.retention import select_versions
from deltaboard.board.server.settings import Settings
from deltaboard.board.server.span_service import SpanBook
from deltaboard.board.server.storage import ObjectNotFound, ObjectStore, asset_key, blob_key

T = TypeVar("T")

log = logging.getLogger("deltaboard.board")

MANIFEST_CACHE_SIZE = 512
KEEPALIVE_S = 15.0
HEAL_ATTEMPTS = 3  # loads of a missing run, each refused if the index is lost during it


def blob_url(run: str, sha256: str) -> str:
    return f"/v1/runs/{run}/blobs/{sha256}"


def newer(head: Head, after: int | None) -> bool:
    """Whether a long-poll that has seen version `after` (None: nothing) takes `head` now."""
    return after is None or (head.version is not None and head.version > after)


class BoardService:
    def __init__(
        self,
        settings: Settings,
        store: ObjectStore,
        index: Index,
        metrics: BoardMetrics,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.store = store
        self.index = index
        self.metrics = metrics
        self.clock = clock
        self.ledger = Ledger(store, clock, metrics)
        # per committed manifest: its JSON and a zstd frame of it (`records.served_manifest`)
        self._manifests: OrderedDict[tuple[str, int], tuple[bytes, bytes]] = OrderedDict()
        self._generation: str | None = None  # the index's, when this process last loaded it
        self._healing: dict[str, asyncio.Future[tuple[RunRecord, Head]]] = {}
        self.prepared = PreparedManifests(clock)
        self.spans = SpanBook(self)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run store I/O in a worker thread: the event loop keeps serving long-polls."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))

    # ---- the index: a cache of the store -------------------------------------------------

    async def start(self) -> None:
        """Open the index and load runs, heads and version records from the store."""
        await self.index.start()
        await self.rebuild()

    async def close(self) -> None:
        await self.index.close()
        await self.blocking(self.store.close)

    async def rebuild(self) -> None:
        """Load every run of the store into the index. The index's generation is read
        first: an index lost while this runs gets a new one, the loads after it write
        nothing (`Index.load_run`), and `check_index` starts again under the new one."""
        generation = await self.index.generation()
        for record in await self.blocking(self.ledger.runs):
            if await self._load(record, generation) is None:
                log.warning("the index was lost again while it was rebuilt: rebuilding it anew")
                return
        self._generation = generation

    async def check_index(self) -> bool:
        """Rebuild the index if it is not the one this process loaded (a Redis flushed, or
        restarted without persistence, has lost its generation marker). Returns whether it
        rebuilt. Meanwhile routes heal the runs they miss (`require_run`)."""
        if await self.index.generation() == self._generation:
            return False
        log.warning("the index lost its generation marker (flushed or restarted): rebuilding it")
        await self.rebuild()
        return True

    async def _load(self, record: RunRecord, generation: str) -> Head | None:
        """The run with its versions and its head, in one write of the index
        (`Index.load_run`): a request that finds the run finds its head, and a poller woken
        by the head finds its plan. Returns the index's head after it (a commit may have put
        a newer one there meanwhile), None where the index is no longer of `generation`
        (nothing written)."""
        stored, _ = await self.blocking(self.ledger.head, record.name)
        records = await self.blocking(self.ledger.committed_versions, record.name, stored.version, None)
        head = stored.wire(record.name)
        if not await self.index.load_run(record, records, head, generation):
            return None
        current = await self.index.get_head(record.name)
        return head if current is None or head_rank(current) < head_rank(head) else current

    async def catch_up(self, run: str, known: Head | None) -> Head:
        """Bring the index's view of `run` up to the store's head (versions first, then the
        head, so that a woken poller finds its plan). Returns the store's head."""
        stored, _ = await self.blocking(self.ledger.head, run)
        head = stored.wire(run)
        if head_rank(stored) <= head_rank(known):
            return head
        after = None if known is None else known.version
        records = await self.blocking(self.ledger.committed_versions, run, stored.version, after)
        await self.index.put_versions(run, records)
        await self.index.advance_head(head)
        return head

    async def reconcile(self) -> None:
        """With a shared index, a replica that dies between its head CAS and its index update
        would leave the others behind: compare each run's head with the store."""
        for record in await self.index.list_runs():
            await self.catch_up(record.name, await self.index.get_head(record.name))

    async def _heal(self, run: str) -> tuple[RunRecord, Head]:
        """A run the index misses, read from the store and put back (`UnknownRun` if the
        store has none). Concurrent misses of one run share one load."""
        task = self._healing.get(run)
        if task is None:
            task = asyncio.ensure_future(self._heal_from_store(run))
            self._healing[run] = task
            task.add_done_callback(functools.partial(self._healed, run))
        return await asyncio.shield(task)

    def _healed(self, run: str, task: asyncio.Future[tuple[RunRecord, Head]]) -> None:
        """Forget the load; its outcome reached whoever still waited (retrieved here so
        that one whose requests all went away is not logged as never retrieved)."""
        self._healing.pop(run, None)
        if not task.cancelled():
            task.exception()

    async def _heal_from_store(self, run: str) -> tuple[RunRecord, Head]:
        record = await self.blocking(self.ledger.run, run)
        if record is None:
            raise UnknownRun(f"run {run!r} does not exist")
        return record, await self._load_now(record)

    async def _load_now(self, record: RunRecord) -> Head:
        """`_load` under the index's generation as it is now, again if the index is lost
        during it (`IndexUnavailable` after `HEAL_ATTEMPTS`)."""
        for _ in range(HEAL_ATTEMPTS):
            head = await self._load(record, await self.index.generation())
            if head is not None:
                return head
        raise IndexUnavailable(f"the board's index was lost while run {record.name!r} was read back into it")

    # ---- runs and assets ---------------------------------------------------------------

    async def require_run(self, run: str) -> RunRecord:
        record = await self.index.get_run(run)
        return record if record is not None else (await self._heal(run))[0]

    async def head(self, run: str) -> Head:
        """The index's head; a run always has one there, so a miss means the index lost it."""
        head = await self.index.get_head(run)
        return head if head is not None else (await self._heal(run))[1]

    async def run_info(self, record: RunRecord) -> RunInfo:
        prefix = asset_key(record.name, "")
        keys = await self.blocking(lambda: [info.key for info in self.store.list(prefix)])
        head = await self.head(record.name)
        return record.info(head.version, tuple(k[len(prefix) :] for k in keys))

    async def create_run(self, req: RunCreate) -> tuple[RunInfo, bool]:
        """Create the run (idempotent): its info and whether it is new."""
        record, created = await self.blocking(self.ledger.create_run, req)
        if await self.index.get_run(req.name) is None:  # new, or lost by the index: with its versions
            await self._load_now(record)
        return await self.run_info(record), created

    async def list_runs(self) -> list[RunRecord]:
        return await self.index.list_runs()

    async def get_run(self, run: str) -> RunInfo:
        return await self.run_info(await self.require_run(run))

    async def put_asset(self, run: str, name: str, path: Path) -> None:
        """Store the received file `path` as the asset (the caller removes the file)."""
        await self.blocking(self.store.put_file, asset_key(run, name), path)

    async def asset(self, run: str, name: str) -> Path | bytes:
        """The asset as a local file, or its bytes where the store is remote."""
        await self.require_run(run)
        key = asset_key(run, name)
        path = self.store.local_path(key)
        if path is not None:
            if not path.is_file():
                raise UnknownAsset(f"asset {name!r} does not exist")
            return path
        try:
            return await self.blocking(self.store.get, key)
        except ObjectNotFound:
            raise UnknownAsset(f"asset {name!r} does not exist") from None

    # ---- the lease ---------------------------------------------------------------------

    async def acquire_lease(self, run: str, req: LeaseRequest) -> Lease:
        await self.require_run(run)
        lease, head = await self.blocking(self.ledger.acquire_lease, run, req)
        await self.index.advance_head(head.wire(run))
        return lease

    async def renew_lease(self, run: str, req: LeaseRenew) -> Lease:
        await self.require_run(run)
        return await self.blocking(self.ledger.renew_lease, run, req)

    async def release_lease(self, run: str, holder: str, epoch: int) -> None:
        await self.require_run(run)
        await self.blocking(self.ledger.release_lease, run, holder, epoch)

    # ---- blobs -------------------------------------------------------------------------

    async def upload_target(self, run: str, sha256: str, size: int) -> BlobUploadTarget:
        """Where to upload a blob; `exists` when the board holds it, which claims it for
        retention's grace period as an upload would."""
        await self.require_run(run)
        if size > self.settings.max_blob_bytes:
            raise BodyTooLarge(f"blobs are limited to {self.settings.max_blob_bytes} bytes")
        key = blob_key(run, sha256)
        if await self.blocking(self.store.stat, key) is not None:
            await self.index.touch_blob(run, sha256, self.clock.now())
            return BlobUploadTarget(sha256=sha256, exists=True, url=None)
        expiry = self.settings.presign_expiry_s
        presigned = await self.blocking(self.store.presign_upload, key, sha256, expiry)
        if presigned is None:
            return BlobUploadTarget(sha256=sha256, exists=False, url=blob_url(run, sha256))
        url, headers = presigned
        return BlobUploadTarget(sha256=sha256, exists=False, url=url, headers=headers)

    async def put_blob(self, run: str, sha256: str, path: Path, size: int, received_sha256: str) -> None:
        """Store a received body under its digest (the caller removes the file)."""
        if received_sha256 != sha256:
            raise DigestMismatch(f"body hashes to {received_sha256}, not {sha256}")
        key = blob_key(run, sha256)
        if await self.blocking(self.store.stat, key) is None:
            await self.blocking(self.store.put_file, key, path)
        self.metrics.blob_bytes_in.inc(size)

    def local_blob(self, run: str, sha256: str) -> Path | None:
        """The blob's file where the store is local (it may be gone: open it to know)."""
        return self.store.local_path(blob_key(run, sha256))

    async def remote_blob(self, run: str, sha256: str, *, presign: bool) -> tuple[int, str | None]:
        """A remote blob's size and, with `presign`, a presigned download URL."""
        key = blob_key(run, sha256)
        info = await self.blocking(self.store.stat, key)
        if info is None:
            raise UnknownBlob(f"blob {sha256} is not stored")
        if not presign:
            return info.size, None
        url = await self.blocking(self.store.presign_download, key, self.settings.presign_expiry_s)
        return info.size, url

    # ---- versions ----------------------------------------------------------------------

    async def prepare(self, run: str, manifest: Manifest) -> Prepared:
        """Check `manifest` on its own and encode it as the store will hold it, for a commit
        that names it (`board.server.prepared`); nothing is stored."""
        await self.require_run(run)
        prepared = await self.blocking(PreparedManifest.of, run, manifest)
        name = self.prepared.put(prepared)
        return Prepared(run=run, version=manifest.version, prepared=name, expires_in_s=self.prepared.ttl_s)

    async def commit(self, run: str, manifest: Manifest | str) -> Head:
        """Commit `manifest`, or the manifest this board prepared under that name (then
        only the rules that need the board's state are left: `UnknownPrepared` if it does
        not hold it)."""
        await self.require_run(run)
        started = self.clock.monotonic()
        if isinstance(manifest, str):
            name, found = manifest, self.prepared.get(run, manifest)
            head_record, durable = await self.blocking(self.ledger.commit, run, found)
            self.prepared.discard(name)
            self.metrics.prepared_commits.inc()
        else:
            head_record, durable = await self.blocking(self.ledger.commit, run, manifest)
        version_record = durable.model_copy(update={"commit_s": self.clock.monotonic() - started})
        head = head_record.wire(run)
        try:
            # The version record goes first: a poller woken by the head must find its plan.
            await self.index.put_versions(run, [version_record])
            await self.index.advance_head(head)
        except IndexUnavailable:
            # The store took the commit, so it is answered as committed; the index learns
            # it when it is back (`check_index`, `reconcile`).
            log.warning("version %d of %r committed while the index was unreachable", head.version, run)
        self.metrics.commits.inc()
        self.metrics.commit_seconds.observe(self.clock.monotonic() - started)
        return head

    async def wait_for_head(self, run: str, after: int | None, wait_s: float) -> Head:
        """The head at once if it is above `after` (or `after` is None); otherwise the next
        head above it, or the current one after `wait_s`. (Waits are timed on the event
        loop's clock, which times asyncio's waits.)"""
        await self.require_run(run)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, self.settings.max_wait_s)
        self.metrics.waits += 1
        try:
            while True:
                # Take the future before reading the head: a commit in between still wakes us.
                future = self.index.waiters.future(run)
                current = await self.head(run)
                if newer(current, after):
                    return current
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return current
                done, _ = await asyncio.wait({future}, timeout=remaining)
                if done:
                    woken = future.result()
                    if newer(woken, after):
                        return woken
        finally:
            self.metrics.waits -= 1

    def known_head(self, run: str) -> Head | None:
        """The head without I/O or a task, where this process holds the index (`Index.known_head`)."""
        return self.index.known_head(run)

    def next_head(self, run: str) -> asyncio.Future[Head]:
        """Resolves with the next head of `run` announced in this process."""
        return self.index.waiters.future(run)

    async def heads(self, run: str) -> AsyncGenerator[Head | None, None]:
        """The current head, then each new one; heads that land faster than the consumer
        reads coalesce into the latest. None every `KEEPALIVE_S` without a commit."""
        await self.require_run(run)
        return self._heads(run)

    async def _heads(self, run: str) -> AsyncGenerator[Head | None, None]:
        last: int | None = None
        sent = False
        self.metrics.waits += 1
        try:
            while True:
                future = self.index.waiters.future(run)
                current = await self.head(run)
                if not sent or current.version != last:
                    yield current
                    last, sent = current.version, True
                done, _ = await asyncio.wait({future}, timeout=KEEPALIVE_S)
                if not done:
                    yield None
        finally:
            self.metrics.waits -= 1

    async def manifest(self, run: str, version: int, packed: bool = False) -> bytes:
        """A committed manifest's JSON, or with `packed` one zstd frame of it (what the board
        stores: a client that accepts zstd gets it without a compression per request, where
        a gzipped fetch of a 20,000-entry manifest took 17 ms against 1.1). Cached: it never
        changes."""
        await self.require_run(run)
        current = await self.head(run)
        if current.version is None or version > current.version:
            raise UnknownVersion(f"version {version} is not committed (head {current.version})")
        served = self._manifests.get((run, version))
        if served is None:
            stored = await self.blocking(self.ledger.stored_manifest, run, version)
            if stored is None:
                raise UnknownVersion(f"version {version} was pruned")
            served = await self.blocking(served_manifest, stored)
            self._manifests[(run, version)] = served
            while len(self._manifests) > MANIFEST_CACHE_SIZE:
                self._manifests.popitem(last=False)
        return served[1] if packed else served[0]

    async def versions(self, run: str, limit: int) -> list[VersionSummary]:
        """The last `limit` committed versions the index holds (retention drops the older
        ones), oldest first."""
        await self.require_run(run)
        current = await self.head(run)
        records = await self.index.versions(run)
        committed = sorted(v for v in records if current.version is not None and v <= current.version)
        return [records[v].summary() for v in committed[-limit:]]

    async def plan(self, run: str, from_version: int | None, to_version: int | None) -> Plan:
        await self.require_run(run)
        try:
            return await self._plan(run, from_version, to_version)
        except NotFound as exc:
            # No chain to a version the index lists is never a healthy index's answer: it
            # holds the run and the newest versions but lost older ones (a Redis restarted
            # between writes; chaos seed 410188417). Otherwise, a run gone from the index
            # means it was lost between our reads. Either way what it answered says nothing
            # about the store: heal the run from there, and plan again. Other misses of a
            # run still there (a pruned base) are the store's answer too, and cost no load.
            if not isinstance(exc, NoChain) and await self.index.get_run(run) is not None:
                raise
            await self._heal(run)
            return await self._plan(run, from_version, to_version)

    async def _plan(self, run: str, from_version: int | None, to_version: int | None) -> Plan:
        current = await self.head(run)
        versions = await self.index.versions(run)
        spans = await self.spans.records(run)
        return planning.plan(run, versions, current.version, from_version, to_version, spans)

    # ---- fleet and retention -----------------------------------------------------------

    async def heartbeat(self, run: str, beat: Heartbeat) -> None:
        await self.require_run(run)
        node = FleetNode(
            node_id=beat.node_id,
            version=beat.version,
            engine=beat.engine,
            meta=beat.meta,
            last_seen=self.clock.now(),
        )
        await self.index.heartbeat(run, node)
        self.metrics.heartbeats.inc()

    async def fleet(self, run: str) -> list[FleetNode]:
        """The nodes heard from within `fleet_ttl_s`."""
        await self.require_run(run)
        return await self.index.fleet(run, self.clock.now() - self.settings.fleet_ttl_s)

    async def retain(self, run: str, policy: RetentionPolicy) -> RetentionReport:
        """Drop the versions retention selects from the index (so that no new plan names
        them), then delete them and the idle unreferenced blobs from the store. What is
        kept, and so which blobs stay referenced, is read from the store: an index that
        lost versions (flushed under us) must not make their blobs look unreferenced."""
        await self.require_run(run)
        stored, _ = await self.blocking(self.ledger.head, run)
        current = stored.wire(run)
        versions = {
            r.version: r for r in await self.blocking(self.ledger.committed_versions, run, current.version)
        }
        touches = await self.index.blob_touches(run)
        spans = await self.spans.records(run, reload=True)
        selection = select_versions(versions, current.version, policy.keep_last, spans)
        await self.index.drop_versions(run, list(selection.delete))
        for version in selection.delete:
            self._manifests.pop((run, version), None)
        for span in selection.delete_spans:  # no new plan names them
            spans.pop((span.from_version, span.to_version), None)
        return await self.blocking(
            self.ledger.retain, run, versions, current.version, selection, policy.grace_s, touches
        )
