"""The durable state machine of the board: every write of a record goes through here.

It works on the object store only (synchronous; the API runs it in worker threads) and
returns what the index must learn. The order of writes is what makes a commit safe:
blobs are checked, the manifest is written create-if-absent, then head.json advances by
compare-and-set on the version tag read before the checks. Granting a lease raises the epoch
in head.json by compare-and-set too, so a writer fenced off mid-commit loses its head CAS.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from deltaboard.board.contract.errors import Contended, LeaseHeld, NotHead, StaleEpoch, UnknownRun
from deltaboard.board.contract.schemas import (
    Lease,
    LeaseRenew,
    LeaseRequest,
    Manifest,
    RetentionReport,
    RunCreate,
)
from deltaboard.board.contract.spans import KeyframeManifest, SpanManifest
from deltaboard.board.server import rules
from deltaboard.board.server.clock import Clock, SystemClock
from deltaboard.board.server.metrics import BoardMetrics
from deltaboard.board.server.prepared import PreparedManifest
from deltaboard.board.server.records import (
    HeadRecord,
    LeaseRecord,
    RunRecord,
    VersionRecord,
    encode,
    manifest_json,
)
from deltaboard.board.server.retention import VersionSelection, apply_retention
from deltaboard.board.server.storage import (
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
    blob_key,
    head_key,
    keyframe_key,
    keyframe_prefix,
    lease_key,
    manifest_key,
    manifest_prefix,
    manifest_version,
    run_key,
    span_key,
    span_prefix,
)

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("deltaboard.board")

CAS_ATTEMPTS = 16


class Ledger:
    def __init__(
        self, store: ObjectStore, clock: Clock | None = None, metrics: BoardMetrics | None = None
    ) -> None:
        self.store = store
        self.clock: Clock = clock or SystemClock()
        self.metrics = metrics
        self._run_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def _exclusive(self, run: str) -> Iterator[None]:
        """Commits and retention of one run in this process, one at a time: a retention
        pass running between a commit's blob check and its manifest write would delete
        blobs that the commit is about to reference. (Across replicas the grace period
        protects them: a commit follows its uploads or dedup claims within it.)"""
        with self._guard:
            lock = self._run_locks.setdefault(run, threading.Lock())
        with lock:
            yield

    # ---- reading records ---------------------------------------------------------------

    def unreadable(self, key: str, error: Exception) -> None:
        """Report a stored record this board cannot read (logged and counted in
        `deltaboard_unreadable_records`): the caller skips it, never fails on it."""
        problem = " ".join(str(error).split())
        log.warning("skipping %s, a stored record this board cannot read: %s", key, problem)
        if self.metrics is not None:
            self.metrics.unreadable_records.inc()

    def _read(self, key: str, model: type[M]) -> tuple[M, str] | None:
        found = self.store.read_record(key)
        return None if found is None else (model.model_validate_json(found[0]), found[1])

    def run(self, run: str) -> RunRecord | None:
        try:
            return RunRecord.model_validate_json(self.store.get(run_key(run)))
        except ObjectNotFound:
            return None

    def head(self, run: str) -> tuple[HeadRecord, str]:
        found = self._read(head_key(run), HeadRecord)
        if found is None:
            raise UnknownRun(f"run {run!r} does not exist")
        return found

    def lease(self, run: str) -> tuple[LeaseRecord, str] | None:
        return self._read(lease_key(run), LeaseRecord)

    def manifest_bytes(self, run: str, version: int) -> bytes | None:
        """A committed manifest's JSON (`manifest_json`), None where none is stored."""
        found = self.stored_manifest(run, version)
        return None if found is None else manifest_json(found)

    def stored_manifest(self, run: str, version: int) -> bytes | None:
        """A committed manifest's record as stored (`records.packed_manifest`, or an older
        board's plain JSON), None where none is stored."""
        found = self.store.read_record(manifest_key(run, version))
        return None if found is None else found[0]

    def blob_size(self, run: str, sha256: str) -> int | None:
        info = self.store.stat(blob_key(run, sha256))
        return None if info is None else info.size

    # ---- runs --------------------------------------------------------------------------

    def create_run(self, req: RunCreate) -> tuple[RunRecord, bool]:
        """Create the run (idempotent). Returns the record and whether it is new."""
        record = RunRecord(name=req.name, created_at=self.clock.now(), meta=req.meta)
        try:
            self.store.put(run_key(req.name), encode(record), if_none_match=True)
        except PreconditionFailed:
            existing = self.run(req.name)
            assert existing is not None
            record, created = existing, False
        else:
            created = True
        # The head record may be missing if a creator died between the two writes.
        with contextlib.suppress(PreconditionFailed):
            self.store.write_record(head_key(req.name), encode(HeadRecord()), None)
        return record, created

    # ---- leases ------------------------------------------------------------------------

    def acquire_lease(self, run: str, req: LeaseRequest) -> tuple[Lease, HeadRecord]:
        """Grant a new epoch unless another holder's lease is live (or `req.steal`); returns
        the lease and the head record carrying the raised epoch."""
        self.head(run)
        for _ in range(CAS_ATTEMPTS):
            now = self.clock.now()
            found = self.lease(run)
            current, tag = found if found is not None else (None, None)
            if (
                current is not None
                and current.expires_at > now
                and current.holder != req.holder
                and not req.steal
            ):
                raise LeaseHeld(
                    f"lease held by {current.holder!r} until {current.expires_at:.0f}",
                    holder=current.holder,
                    expires_at=current.expires_at,
                )
            head, _ = self.head(run)
            epoch = max(head.epoch, current.epoch if current else 0) + 1
            record = LeaseRecord(holder=req.holder, epoch=epoch, expires_at=now + req.ttl_s)
            try:
                self.store.write_record(lease_key(run), encode(record), tag)
            except PreconditionFailed:
                continue
            lease = Lease(run=run, holder=record.holder, epoch=record.epoch, expires_at=record.expires_at)
            return lease, self._raise_head_epoch(run, epoch)
        raise Contended("lease record kept changing; retry")

    def _raise_head_epoch(self, run: str, epoch: int) -> HeadRecord:
        for _ in range(CAS_ATTEMPTS):
            head, tag = self.head(run)
            if head.epoch >= epoch:
                return head
            raised = head.model_copy(update={"epoch": epoch})
            try:
                self.store.write_record(head_key(run), encode(raised), tag)
                return raised
            except PreconditionFailed:
                continue
        raise Contended("head record kept changing; retry")

    def _own_lease(self, run: str, holder: str, epoch: int) -> tuple[LeaseRecord, str]:
        found = self.lease(run)
        if found is None or found[0].holder != holder or found[0].epoch != epoch:
            current = None if found is None else found[0].epoch
            raise StaleEpoch(f"epoch {epoch} of {holder!r} is not the current lease", current_epoch=current)
        return found

    def renew_lease(self, run: str, req: LeaseRenew) -> Lease:
        self.head(run)
        now = self.clock.now()
        renewed = self._rewrite_own_lease(run, req.holder, req.epoch, expires_at=now + req.ttl_s)
        return Lease(run=run, holder=req.holder, epoch=req.epoch, expires_at=renewed.expires_at)

    def release_lease(self, run: str, holder: str, epoch: int) -> None:
        """Expire the lease now; the epoch stays, so the next lease gets a higher one."""
        self.head(run)
        self._rewrite_own_lease(run, holder, epoch, expires_at=0.0)

    def _rewrite_own_lease(self, run: str, holder: str, epoch: int, expires_at: float) -> LeaseRecord:
        """The lease of `holder` at `epoch` with a new expiry, by compare-and-set. A record
        changed between the read and the write is read again: the holder's own renewal can
        change it (a retry of a renewal that timed out while the first still ran, or a
        store's retry of a write that had landed), and that is no reason to fence it; a
        lease another writer took is (`_own_lease`: `StaleEpoch`)."""
        for _ in range(CAS_ATTEMPTS):
            record, tag = self._own_lease(run, holder, epoch)
            rewritten = record.model_copy(update={"expires_at": expires_at})
            try:
                self.store.write_record(lease_key(run), encode(rewritten), tag)
            except PreconditionFailed:
                continue
            return rewritten
        raise Contended("lease record kept changing; retry")

    # ---- commit ------------------------------------------------------------------------

    def commit(self, run: str, manifest: Manifest | PreparedManifest) -> tuple[HeadRecord, VersionRecord]:
        """Commit `manifest` as head + 1: checked on its own and encoded as stored
        (`PreparedManifest.of`) unless that was done when it was prepared, then under the
        run's lock checked against the board's state and written."""
        prepared = manifest if isinstance(manifest, PreparedManifest) else PreparedManifest.of(run, manifest)
        with self._exclusive(run):
            return self._commit(run, prepared)

    def retain(
        self,
        run: str,
        versions: Mapping[int, VersionRecord],
        head: int | None,
        selection: VersionSelection,
        grace_s: float,
        touches: Mapping[str, float],
    ) -> RetentionReport:
        """Apply retention (`retention`) to the store, never in the middle of a commit."""
        with self._exclusive(run):
            now = self.clock.now()
            return apply_retention(self.store, run, versions, head, selection, grace_s, touches, now)

    def _commit(self, run: str, prepared: PreparedManifest) -> tuple[HeadRecord, VersionRecord]:
        manifest, as_json, data = prepared.manifest, prepared.as_json, prepared.packed
        head, head_tag = self.head(run)
        found = self.lease(run)
        rules.check_commit(manifest, head, None if found is None else found[0], self.clock.now())
        sizes = {sha: self.blob_size(run, sha) for sha in manifest.blob_shas()}
        rules.check_blob_ranges(manifest, sizes)
        new_head = HeadRecord(version=manifest.version, kind=manifest.kind, epoch=manifest.epoch)
        key = manifest_key(run, manifest.version)
        head_write = (head_key(run), encode(new_head), head_tag)
        # The manifest create-if-absent, then the head CAS, durable together.
        written = self.store.write_records([(key, data, None), head_write])
        if written == 0:
            # Rewritten even when the slot holds our own bytes: a crashed attempt may have
            # set them without making them durable.
            slot = self._take_manifest_slot(run, manifest, as_json, head)
            written = self.store.write_records([(key, data, slot), head_write])
        if written < 2:
            now, _ = self.head(run)
            if now.epoch > manifest.epoch:
                raise StaleEpoch(f"epoch {manifest.epoch} was fenced off", current_epoch=now.epoch)
            raise NotHead(f"version {manifest.version} was committed concurrently", head=now.version)
        stored = {k: v for k, v in sizes.items() if v is not None}
        return new_head, VersionRecord.of(manifest, stored, len(as_json))

    def _take_manifest_slot(self, run: str, manifest: Manifest, as_json: bytes, head: HeadRecord) -> str:
        """The manifest's create-if-absent lost. What is there above head is either our own
        retry (the same JSON, packed or as an older board stored it), a fenced writer's
        leftover (lower epoch), both to be replaced by compare-and-set on the tag returned,
        or a concurrent commit of the same epoch (refused)."""
        found = self.store.read_record(manifest_key(run, manifest.version))
        if found is None:
            raise NotHead("manifest slot changed concurrently; retry")
        stored, tag = found
        existing = manifest_json(stored)  # our own attempt's, packed or (an older board's) not
        if existing == as_json:
            return tag
        try:
            other = Manifest.model_validate_json(existing)
        except ValidationError:
            other = None
        if other is None or other.epoch < manifest.epoch:
            return tag
        raise NotHead(f"version {manifest.version} is being committed by another writer", head=head.version)

    # ---- derived data: spans and worker keyframes --------------------------------------

    def _put_once(self, key: str, data: bytes) -> tuple[bytes, bool]:
        """Store verified derived data unless the same name is there: create-if-absent is
        one atomic write, so racing workers leave exactly one and a killed one leaves
        none. The stored bytes, and whether this call stored them."""
        try:
            self.store.put(key, data, if_none_match=True)
        except PreconditionFailed:
            return self.store.get(key), False
        return data, True

    def _get(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except ObjectNotFound:
            return None

    def _all(self, prefix: str, model: type[M]) -> list[tuple[M, int]]:
        """Every stored object under `prefix` this board can read, with its stored size
        (the others are reported and skipped: plans route around them)."""
        out = []
        for info in self.store.list(prefix):
            try:
                data = self.store.get(info.key)
                out.append((model.model_validate_json(data), len(data)))
            except ObjectNotFound:
                continue
            except ValidationError as e:
                self.unreadable(info.key, e)
        return out

    def put_span(self, run: str, span: SpanManifest) -> tuple[bytes, bool]:
        return self._put_once(span_key(run, span.from_version, span.to_version), encode(span))

    def span_bytes(self, run: str, from_version: int, to_version: int) -> bytes | None:
        return self._get(span_key(run, from_version, to_version))

    def spans(self, run: str) -> list[tuple[SpanManifest, int]]:
        return self._all(span_prefix(run), SpanManifest)

    def put_keyframe(self, run: str, keyframe: KeyframeManifest) -> tuple[bytes, bool]:
        return self._put_once(keyframe_key(run, keyframe.version), encode(keyframe))

    def keyframe_bytes(self, run: str, version: int) -> bytes | None:
        return self._get(keyframe_key(run, version))

    def keyframes(self, run: str) -> list[tuple[KeyframeManifest, int]]:
        return self._all(keyframe_prefix(run), KeyframeManifest)

    # ---- rebuilding the index -----------------------------------------------------------

    def runs(self) -> list[RunRecord]:
        """Every run whose record this board can read (the others are reported and skipped)."""
        out = []
        for info in self.store.list("runs/"):
            parts = info.key.split("/")
            if len(parts) == 3 and parts[2] == "run.json":
                try:
                    record = self.run(parts[1])
                except ValidationError as e:
                    self.unreadable(info.key, e)
                    continue
                if record is not None:
                    out.append(record)
        return out

    def committed_versions(self, run: str, head: int | None, after: int | None = None) -> list[VersionRecord]:
        """Version records of the committed manifests (above `after`) still stored, for the
        index. A manifest this board cannot read (stored by an older, laxer board, or
        damaged in the store) is reported (`unreadable`) and left out: plans route around
        it, and the board still starts and serves every other version."""
        if head is None:
            return []
        records = []
        listed = {manifest_version(info.key) for info in self.store.list(manifest_prefix(run))}
        for version in sorted(v for v in listed if v is not None):
            if version > head or (after is not None and version <= after):
                continue
            data = self.manifest_bytes(run, version)
            if data is None:
                continue
            try:
                manifest = Manifest.model_validate_json(data)
            except ValidationError as e:
                self.unreadable(manifest_key(run, version), e)
                continue
            sizes = {sha: self.blob_size(run, sha) or 0 for sha in manifest.blob_shas()}
            records.append(VersionRecord.of(manifest, sizes, len(data)))
        return records
