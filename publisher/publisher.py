"""`Publisher`: one call after each optimizer step; the version reaches the board behind it.

    pub = Publisher("http://board:8000", "run-1", token=...)
    fut = pub.publish(model, step=step)   # blocks only for the snapshot copy
    ...
    pub.close()                           # flush, then give the writer lease back

The first version this publisher commits is a keyframe (with the run's assets, so that a
materialized directory is a loadable Hugging Face checkpoint: the model's own config and
generation config unless `assets=` names others); later ones are deltas against the last
committed view, with a keyframe whenever `version % keyframe_every == 0` and whenever the
tensors change (names added or dropped, a shape changed: the result says which).

A restarted trainer continues the run with deltas: when the first view a publisher sees
is the board's head (the trainer resumed from the checkpoint it last published; the
state digests agree), that view becomes the base and nothing is committed for it. So
publish the policy as training starts, as well as after each step.

Memory, in bytes (documented bound, see `memory_bound_bytes`):
  device: (1 + max_in_flight) * view_bytes   view buffers (`pipeline`), plus the diff's
          transient mask of at most `device_diff.CHUNK_ELEMENTS` bytes (torch path), or
          the fused pass' bitmask and tile table (about 1/16 of a diff batch's bytes);
  host:   max_pending_blob_bytes + blob_max_bytes   blobs sealed or being packed (`packer`),
          plus 2 * encode_workers bundles' bytes while a keyframe encodes (a large tensor, or
          small ones of at most ~2 x `encode.BUNDLE_ELEMENTS` elements), plus the changes of three
          diff batches (one encoding, one bundled behind it, one diffed: `device_diff.iter_diffs`
          and `encode`; ~12 bytes per changed bf16 element), plus
          the host tensors' kept exponent counts (`exponents`: 8 bytes per exponent value of
          each tensor's dtype, 2 KiB per bf16 or fp32 tensor; one table, moved from view to view),
          plus on CUDA with hints the device tensors' kept sampled counts (`sampled_counts`:
          8 bytes per exponent value of the view's widest floating dtype per tensor, a table
          per view buffer).

The codec's context encoding (`context`) makes deltas smaller (docs/design.md has the
measured figures): every follower downloads, and the board stores, that much less. It
reads the old exponent class of every element. On the CPU the publisher hands the codec
the old bytes in place; on CUDA the diff computes a hint on the device (`device_diff`:
exponent counts that follow the changes, the ranks of the tensors whose classes pay off).
Either way the cost is background time, none of it on the trainer thread (on an H200 the
hinted 8 GB pass takes 1.6x to 5x the unhinted one's ~17 ms, design.md), so the default
(`None`) uses it everywhere; `context=False` turns it off, `context=True` is the same as
the default.

Threads: the caller's (snapshot only), one worker (orders the stages, commits), a diff
helper, an encoder pool (`encode_workers`, default min(4, cores)), an upload pool, and
the lease renewer.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from deltaboard.board import codec
from deltaboard.board.contract.errors import BoardError, NotHead, StaleEpoch
from deltaboard.board.contract.schemas import Manifest, ViewSpec
from deltaboard.board.contract.view_spec import unmatched_rules
from deltaboard.clients.board_client import BoardClient
from deltaboard.publisher.assets import describe_view, model_assets, read_assets
from deltaboard.publisher.encode import LocalSlice, RankVersion, encode_rank
from deltaboard.publisher.lease import FencedError, LeaseKeeper
from deltaboard.publisher.manifest import Proposal, build_manifest
from deltaboard.publisher.packer import BlobPacker
from deltaboard.publisher.pipeline import Job, SnapshotPipeline
from deltaboard.publisher.quantize import quantize_state
from deltaboard.publisher.ranks import RankCoordinator, RankReport, SingleRank, Verdict
from deltaboard.publisher.snapshot import LayoutChange, ViewBuffer
from deltaboard.publisher.tied import ModelOrState, state_of

log = logging.getLogger(__name__)

MiB = 1 << 20
Progress = Callable[[int], None]
NO_ASSETS = (
    "publish() was given no Hugging Face model (a state dict, or a module without a config) "
    "and the Publisher no assets=: the directory a follower "
    "materializes would have no config.json, and from_pretrained could not load it. Publish the "
    "model itself (its config and generation config are taken), pass assets= (a checkpoint "
    "directory or {name: bytes}), or assets={} to publish the weights alone."
)


class PublishError(RuntimeError):
    """A version was not committed (its future carries this, or the cause)."""


@dataclass(frozen=True)
class PublishResult:
    """A committed version, as the publishing rank saw it."""

    version: int
    kind: Literal["full", "delta"]
    step: int | None
    changed_elements: int  # this rank's
    total_elements: int
    encoded_bytes: int  # this rank's blob bytes
    host_bytes: int  # bytes the diff moved device -> host (0 for keyframes)
    blocked_s: float  # time the caller spent inside publish()
    e2e_s: float  # from the publish() call to the commit
    diff_s: float  # the device diff (part of encode_s)
    encode_s: float  # diff, encode and upload of this rank's part (a lone rank: and the board's prepare)
    commit_s: float  # gathering the ranks' parts and committing
    manifest_bytes: int  # the committed manifest's JSON (what every follower reads), 0 if none
    layout_change: LayoutChange | None  # the tensors changed: this version is a keyframe
    resumed: bool  # the view was already `version` (a restarted trainer's): nothing committed


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Publisher:
    """Publishes successive versions of one run's rollout view.

    From one process by default; with `ranks` (see `ranks` and `distributed`), one
    `Publisher` per rank, each publishing its part of every version.

    `assets`: the files a follower's directory needs besides the weights (a checkpoint
    directory, or {name: bytes}); by default the published model's config. `config.json`
    is rewritten to say the view's dtype. `steal_lease=True` takes the run from a writer
    whose lease is still live, which fences that writer off.
    """

    def __init__(
        self,
        board: str | BoardClient,
        run: str,
        *,
        token: str | None = None,
        spec: ViewSpec | None = None,
        keyframe_every: int = 50,
        max_in_flight: int = 1,
        assets: str | Path | Mapping[str, bytes] | None = None,
        holder: str | None = None,
        lease_ttl_s: float = 30.0,
        upload_workers: int = 4,
        encode_workers: int | None = None,
        blob_max_bytes: int = 64 * MiB,
        max_pending_blob_bytes: int = 256 * MiB,
        steal_lease: bool = False,
        on_uploaded: Progress | None = None,
        context: bool | None = None,
        ranks: RankCoordinator | None = None,
    ) -> None:
        if keyframe_every < 1:
            raise ValueError("keyframe_every must be at least 1")
        self._owns_client = not isinstance(board, BoardClient)
        self.client = board if isinstance(board, BoardClient) else BoardClient(board, token=token)
        self.run = run
        self.spec = spec or ViewSpec()
        self.keyframe_every = keyframe_every
        # None: the published model's own, taken at its first publish (`_assets_due`)
        self._given_assets = None if assets is None else describe_view(read_assets(assets), self.spec)
        self._first_publish = True
        self._pending_assets: dict[str, bytes] = {}  # the worker's: uploaded with the next commit
        self._blob_max = blob_max_bytes
        self._max_pending = max_pending_blob_bytes
        self._on_uploaded = on_uploaded
        self._context = context
        self._uploads = ThreadPoolExecutor(upload_workers, thread_name_prefix=f"deltaboard-upload-{run}")
        self._encode_workers = encode_workers or min(4, os.cpu_count() or 1)
        self._encoders = ThreadPoolExecutor(
            self._encode_workers, thread_name_prefix=f"deltaboard-encode-{run}"
        )
        self._digests: dict[str, str] = {}
        self._ranks = ranks or SingleRank()
        # sharded state: where this rank's tensors sit in whole ones (fixed for a run of
        # several ranks), and each slice's digest at global positions
        self._slices: Mapping[str, LocalSlice] = {}
        self._slice_digests: dict[str, str] = {}
        # a lone publisher's first view may be the head's (`_resume`)
        self._may_resume = self._ranks.world_size == 1
        self._lease: LeaseKeeper | None = None  # the leader's only
        # a lone rank's manifest made while its last blob uploads (`_prepare`), with its JSON
        # ... and the name the board prepared it under (None: not prepared there)
        self._prepared: tuple[RankVersion, Manifest, str, str | None] | None = None
        self._fenced: FencedError | None = None  # a verdict said so
        try:
            self.next_version = self._ranks.open_run(
                lambda: self._open_run(holder or default_holder(), lease_ttl_s, steal_lease)
            )
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise
        self._pipeline: SnapshotPipeline[PublishResult] = SnapshotPipeline(
            self.spec, self._process, max_in_flight=max_in_flight, name=run
        )
        self._closed = False

    # ---- the ranks' agreement (`ranks.RankCoordinator` carries the messages) ----

    def _open_run(self, holder: str, ttl_s: float, steal: bool) -> int:
        """The leader's opening: create the run, take the writer lease, read the head."""
        self.client.create_run(self.run)
        self._lease = LeaseKeeper(self.client, self.run, holder, ttl_s, steal=steal)
        return self._board_next_version()

    def _check_open(self) -> None:
        """Raise at once in `publish` when this publisher can no longer commit. A lone rank
        checks its lease; among several, every rank learns of fencing from the same verdict,
        so all stop together (the leader refusing alone would leave the others waiting)."""
        if self._ranks.world_size == 1 and self._lease is not None:
            self._lease.check()
        if self._fenced is not None:
            raise self._fenced

    def _settle(self, proposal: Proposal, outcome: RankVersion | BaseException) -> Verdict:
        """Commit the version if every rank's part is uploaded; raise on every rank if not.

        The rank that failed raises its own error, the leader the error of its commit;
        the others raise the verdict (`FencedError`, or `PublishError` saying why).
        """
        errors: list[BaseException] = []  # the leader's own, raised there as they are
        verdict = self._ranks.settle_version(outcome, lambda reports: self._decide(proposal, reports, errors))
        if verdict.resynced and self._ranks.rank != 0:
            self._pipeline.forget_base()
        self.next_version = verdict.next_version
        if verdict.status == "ok":
            return verdict
        if verdict.status == "fenced":
            self._fenced = FencedError(verdict.message)
        if isinstance(outcome, BaseException):
            raise outcome
        if errors:
            raise errors[0]
        raise self._fenced or PublishError(verdict.message)

    def _decide(
        self, proposal: Proposal, reports: Sequence[RankReport], errors: list[BaseException]
    ) -> Verdict:
        """The leader's decision: commit only if it still holds the lease and no rank failed."""
        assert self._lease is not None
        try:
            self._lease.check()
        except FencedError as exc:
            errors.append(exc)
            return Verdict("fenced", str(exc), proposal.version, False)
        failures = [r for r in reports if isinstance(r, str)]
        if failures:
            message = f"version {proposal.version} not committed: {'; '.join(failures)}"
            return Verdict("failed", message, proposal.version, False)
        try:
            manifest_bytes = self._commit(proposal, [r for r in reports if isinstance(r, RankVersion)])
        except FencedError as exc:
            errors.append(exc)
            return Verdict("fenced", str(exc), proposal.version, False)
        except Exception as exc:
            errors.append(exc)
            resynced = self.next_version != proposal.version
            return Verdict("failed", str(exc), self.next_version, resynced)
        return Verdict("ok", "", proposal.version + 1, False, manifest_bytes)

    # ---- public API ----

    @property
    def epoch(self) -> int | None:
        return None if self._lease is None else self._lease.epoch

    @property
    def memory_bound_bytes(self) -> int:
        """Device view buffers plus host blob buffers: the bound documented above."""
        return self._pipeline.memory_bytes + self._max_pending + self._blob_max

    def adopt_base(self, version: int, view: Mapping[str, torch.Tensor]) -> None:
        """Continue a run from `version`, whose view the caller holds (e.g. a follower's copy).

        The next publish is then a delta against it instead of a keyframe. The view is
        checked against the board's state digest of that version, so a wrong or stale
        copy is refused here rather than producing patches against the wrong base.
        """
        if version != self.next_version - 1:
            raise ValueError(f"version {version} is not the head ({self.next_version - 1})")
        buffer = self._pipeline.adopt_base(view)
        digests = self._digests_if(buffer, self.client.manifest(self.run, version))
        if digests is None:
            self._pipeline.forget_base()
            raise ValueError(f"the given view is not version {version} of run {self.run!r}")
        self._digests = digests

    def publish(
        self,
        model_or_state_dict: ModelOrState,
        *,
        step: int | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Future[PublishResult]:
        """Snapshot the rollout view now; diff, encode, upload and commit in the background.

        Blocks only for the snapshot copy, or while `max_in_flight` versions are already
        queued (back-pressure). The future resolves to the committed version or raises
        why it was not committed (`FencedError` once another writer took the run).
        """
        if self._closed:
            raise RuntimeError("publish() after close()")
        self._check_open()
        # FP8 block rules: the weights are quantized here, on their device; the snapshot
        # copies the FP8 bytes and scales like any other tensor.
        whole = state_of(model_or_state_dict)
        state = quantize_state(self._ranks.local_state(whole), self.spec)
        self._slices = self._ranks.local_slices(whole)
        if self._slices and set(state) - set(self._slices):
            # a block's scale depends on elements other ranks hold
            raise ValueError("FP8 block views of sharded tensors are not supported: serve them in bf16")
        change = self._pipeline.layout_change(state)
        if change is not None and self._ranks.world_size > 1:
            raise ValueError(
                f"the tensors changed since the last version ({change}): ranks publishing together "
                "cannot change their tensors within a run; start a new run"
            )
        if self._ranks.rank == 0 and (self._pipeline.layout is None or change is not None):
            for rule in unmatched_rules(list(whole), self.spec):
                log.warning(
                    "view rule %r (%s) matches no tensor of the published state, so it serves none "
                    "(patterns are globs: '*' matches every name, 'model.layers.*' a prefix)",
                    rule.pattern,
                    rule.dtype,
                )
        assets = self._assets_due(model_or_state_dict, change)
        return self._pipeline.submit(state, step, meta or {}, change=change, assets=assets)

    def _assets_due(self, published: ModelOrState, change: LayoutChange | None) -> dict[str, bytes]:
        """The assets to upload with this version (the leader's): the given ones or the
        model's own with the first publish, and the model's own again when its tensors
        changed (`resize_token_embeddings` changes its config too). Every rank checks
        alike, so that all refuse a state dict without assets, not the leader alone."""
        first = self._first_publish
        assets: dict[str, bytes] = {}
        if self._given_assets is not None:
            assets = self._given_assets if first else {}
        elif first or change is not None:
            found = model_assets(published)
            if found is None and first:
                raise ValueError(NO_ASSETS)
            assets = {} if found is None else describe_view(found, self.spec)
        self._first_publish = False
        return assets if self._ranks.rank == 0 else {}

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every published version is committed or failed."""
        self._pipeline.flush(timeout)

    def close(self) -> None:
        """Flush, stop the background threads and release the writer lease."""
        if self._closed:
            return
        self._closed = True
        self._pipeline.close()
        self._uploads.shutdown()
        self._encoders.shutdown()
        if self._lease is not None:
            self._lease.release()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the background worker ----

    def _process(self, job: Job[PublishResult], base: ViewBuffer | None) -> PublishResult:
        version = self.next_version
        self._pending_assets.update(job.assets)
        if self._may_resume:
            self._may_resume = False
            resumed = self._resume(job) if base is None and version > 0 else None
            if resumed is not None:
                return resumed
        full = base is None or version % self.keyframe_every == 0
        proposal = Proposal(version, "full" if full else "delta", job.step, job.meta)
        outcome: RankVersion | BaseException
        started = time.perf_counter()
        try:
            if self._lease is not None:
                self._lease.check()
            job.buffer.wait_ready()
            outcome = encode_rank(
                job.buffer,
                None if full else base,
                self._digests,
                self._packer(),
                self._encoders,
                window=2 * self._encode_workers,
                context=self._context,
                slices=self._slices,
                base_slice_digests=self._slice_digests,
                while_uploading=None if self._ranks.world_size > 1 else partial(self._prepare, proposal),
            )
        except Exception as exc:
            outcome = exc
        encoded = time.perf_counter()
        verdict = self._settle(proposal, outcome)
        assert isinstance(outcome, RankVersion)
        committed = time.perf_counter()
        self._digests = dict(outcome.digests)
        self._slice_digests = dict(outcome.slice_digests)
        self.next_version = version + 1
        return PublishResult(
            version=version,
            kind=proposal.kind,
            step=job.step,
            changed_elements=outcome.changed_elements,
            total_elements=outcome.total_elements,
            encoded_bytes=sum(outcome.parts.lengths),
            host_bytes=outcome.host_bytes,
            blocked_s=job.blocked_s,
            e2e_s=committed - job.called_at,
            diff_s=outcome.diff_s,
            encode_s=encoded - started,
            commit_s=committed - encoded,
            manifest_bytes=verdict.manifest_bytes,
            layout_change=job.change,
            resumed=False,
        )

    def _resume(self, job: Job[PublishResult]) -> PublishResult | None:
        """The first view of a publisher over a run with a head: when it is the head's view
        (a trainer restarted from the checkpoint it had published), it becomes the base of
        the next delta and nothing is committed; else None (a keyframe follows)."""
        started = time.perf_counter()
        head = self.next_version - 1
        manifest = self.client.manifest(self.run, head)
        job.buffer.wait_ready()
        digests = self._digests_if(job.buffer, manifest)
        if digests is None:
            return None
        self._digests = digests
        done = time.perf_counter()
        return PublishResult(
            version=head,
            kind=manifest.kind,
            step=job.step,
            changed_elements=0,
            total_elements=sum(s.numel for s in job.buffer.layout.slots),
            encoded_bytes=0,
            host_bytes=0,
            blocked_s=job.blocked_s,
            e2e_s=done - job.called_at,
            diff_s=0.0,
            encode_s=done - started,
            commit_s=0.0,
            manifest_bytes=0,
            layout_change=None,
            resumed=True,
        )

    def _digests_if(self, buffer: ViewBuffer, manifest: Manifest) -> dict[str, str] | None:
        """The view's tensor digests if it is `manifest`'s version (same view spec, same
        state digest), else None."""
        if manifest.view != self.spec:
            return None
        digests = {s.name: codec.digest(buffer.host_bytes(s), s.dtype) for s in buffer.layout.slots}
        return digests if codec.state_digest(digests.items()) == manifest.state_digest else None

    def _packer(self) -> BlobPacker:
        return BlobPacker(
            self._upload_blob,
            self._uploads,
            blob_max_bytes=self._blob_max,
            max_pending_bytes=self._max_pending,
            on_uploaded=self._on_uploaded,
        )

    def _upload_blob(self, sha: str, data: bytes) -> None:
        """Idempotent: the board answers `exists` for a blob it holds; the client retries."""
        self.client.upload_blob(self.run, data, sha)

    def _commit(self, proposal: Proposal, ranks: list[RankVersion]) -> int:
        """Upload the assets still due, then commit the manifest (the leader's job);
        returns the manifest's size in bytes."""
        assert self._lease is not None
        self._lease.check()
        for name, data in list(self._pending_assets.items()):
            self.client.put_asset(self.run, name, data)
            del self._pending_assets[name]
        try:
            try:
                return self._send(proposal, ranks)
            except NotHead:
                if self._board_next_version() != proposal.version:
                    raise
                # The head did not move, yet the slot above it is taken under our epoch: by
                # our own earlier attempt, whose manifest landed but whose head CAS did not
                # (a board crash in between, then retries given up). A new epoch replaces it.
                self._lease.take_new_epoch()
                return self._send(proposal, ranks)
        except NotHead as exc:
            self._resync()
            raise PublishError(f"version {proposal.version} was not committed: {exc}") from exc

    def _prepare(self, proposal: Proposal, version: RankVersion) -> None:
        """A lone rank's manifest of `version` and its JSON, made while its last blob
        uploads (`encode_rank`'s `while_uploading`), and sent for the board to check and
        hold (`BoardClient.prepare`): for a model of many tensors the manifest's build and
        dump, and the board's parse, rules and encoding of it, are otherwise serial between
        the upload and the commit. A board that cannot prepare it (an older one, or a
        failure) gets the manifest itself at the commit."""
        assert self._lease is not None
        manifest = build_manifest(self.run, proposal, self.spec, self._lease.epoch, [version])
        manifest_json = manifest.model_dump_json()
        try:
            name: str | None = self.client.prepare(self.run, manifest, manifest_json).prepared
        except (BoardError, httpx.TransportError) as exc:
            log.debug("version %d not prepared on the board (%s): committed whole", proposal.version, exc)
            name = None
        self._prepared = (version, manifest, manifest_json, name)

    def _send(self, proposal: Proposal, ranks: list[RankVersion]) -> int:
        """Commit the manifest under the current epoch, serialized once for the request and
        its size, which it returns (the one `_prepare` made, where it was made of these ranks'
        parts for this version and epoch); `NotHead` is left to the caller."""
        assert self._lease is not None
        prepared, self._prepared = self._prepared, None
        if (
            prepared is not None
            and len(ranks) == 1
            and ranks[0] is prepared[0]
            and prepared[1].version == proposal.version
            and prepared[1].epoch == self._lease.epoch
        ):
            _, manifest, manifest_json, name = prepared
        else:
            manifest = build_manifest(self.run, proposal, self.spec, self._lease.epoch, ranks)
            manifest_json, name = manifest.model_dump_json(), None
        try:
            self.client.commit(self.run, manifest, manifest_json, prepared=name)
        except StaleEpoch as exc:
            raise self._lease.fence(f"the board refused version {proposal.version}") from exc
        except NotHead:
            raise
        except BoardError as exc:
            raise PublishError(f"version {proposal.version} was not committed: {exc}") from exc
        return len(manifest_json.encode())

    def _board_next_version(self) -> int:
        head = self.client.head(self.run).version
        return 0 if head is None else head + 1

    def _resync(self) -> None:
        """The head moved under us: continue after it, from a keyframe (no collective here:
        among several ranks only the leader runs this, inside its verdict)."""
        self.next_version = self._board_next_version()
        self._pipeline.forget_base()


__all__ = ["FencedError", "PublishError", "PublishResult", "Publisher"]
