"""Pure version rules of a commit (no I/O): what the board checks before it writes.

Versions are contiguous and immutable; version 0 is a keyframe; a commit names the head as
its parent; the manifest satisfies the contract's rules on its own
(`board.contract.manifest_rules`); a commit's epoch must be the epoch of the current lease,
which must be live (fencing); every blob range a manifest references must lie inside a
stored blob.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

from deltaboard.board.contract.errors import BadManifest, MissingBlobs, NoLease, NotHead, StaleEpoch
from deltaboard.board.contract.manifest_rules import check_manifest, first_true
from deltaboard.board.contract.schemas import Manifest, TensorTable
from deltaboard.board.contract.spans import KeyframeManifest, SpanManifest
from deltaboard.board.server.records import HeadRecord, LeaseRecord


def check_manifest_shape(manifest: Manifest, run: str) -> None:
    """Rules a manifest must satisfy on its own, whatever the board holds."""
    if manifest.run != run:
        raise BadManifest(f"manifest is for run {manifest.run!r}, posted to {run!r}")
    if manifest.version == 0:
        if manifest.kind != "full":
            raise BadManifest("version 0 must be a keyframe (kind 'full')")
        if manifest.parent is not None:
            raise BadManifest("version 0 has no parent")
    elif manifest.parent != manifest.version - 1:
        raise BadManifest(f"version {manifest.version} must name parent {manifest.version - 1}")
    check_manifest(manifest)  # a name twice only as parts of one tensor


def expected_version(head: HeadRecord) -> int:
    return 0 if head.version is None else head.version + 1


def check_fencing(manifest: Manifest, head: HeadRecord, lease: LeaseRecord | None, now: float) -> None:
    """The writer's epoch must be the current lease's (a lower one was fenced off), and that
    lease must be live at `now`: a released or expired lease lets another writer in at any
    moment, so its holder may no longer commit."""
    if lease is None:
        raise NoLease("take a lease (POST .../lease) before committing", epoch=manifest.epoch)
    lease_epoch = lease.epoch
    current = max(lease_epoch, head.epoch)
    if manifest.epoch < current:
        raise StaleEpoch(
            f"epoch {manifest.epoch} was fenced off by epoch {current}",
            epoch=manifest.epoch,
            current_epoch=current,
        )
    if manifest.epoch != lease_epoch:
        raise StaleEpoch(f"epoch {manifest.epoch} was never granted", current_epoch=current)
    if lease.expires_at <= now:
        raise NoLease(
            f"the lease of epoch {lease_epoch} was released or has expired: take a new lease",
            epoch=manifest.epoch,
        )


def check_succession(manifest: Manifest, head: HeadRecord) -> None:
    """Only head+1 may be committed: duplicates and gaps are refused."""
    want = expected_version(head)
    if manifest.version != want:
        raise NotHead(
            f"version {manifest.version} does not follow head {head.version} (expected {want})",
            head=head.version,
        )


def check_blob_ranges(
    manifest: Manifest | SpanManifest | KeyframeManifest, sizes: Mapping[str, int | None]
) -> None:
    """Every referenced blob exists and covers each entry's offset + length (of a version or
    of a span alike). A version's ranges are compared column by column in C-level
    iterators, with no Python step per entry (a manifest of 20,000 tensors)."""
    missing = sorted(sha for sha in manifest.blob_shas() if sizes.get(sha) is None)
    if missing:
        raise MissingBlobs(f"{len(missing)} referenced blobs are not stored", missing=missing)
    stored = {sha: size for sha, size in sizes.items() if size is not None}
    if isinstance(manifest, Manifest):
        c = TensorTable.of(manifest.tensors).columns
        blob_sizes = [stored[sha] for sha in c.blobs]
        ends = map(operator.add, c.offset, c.length)
        beyond = map(operator.gt, ends, map(blob_sizes.__getitem__, c.blob))
        i = first_true(beyond)
        if i is not None:
            raise _range_error(c.name[i], c.offset[i], c.length[i], blob_sizes[c.blob[i]])
        return
    for e in manifest.tensors:
        size = stored[e.blob.sha256]
        if e.blob.offset + e.blob.length > size:
            raise _range_error(e.name, e.blob.offset, e.blob.length, size)


def _range_error(name: str, offset: int, length: int, size: int) -> BadManifest:
    return BadManifest(f"tensor {name!r}: range {offset}+{length} exceeds blob size {size}")


def check_commit(manifest: Manifest, head: HeadRecord, lease: LeaseRecord | None, now: float) -> None:
    """The rules that need the board's state but not blob sizes, in the order a client can
    act on them (after `check_manifest_shape`, the manifest's own)."""
    check_fencing(manifest, head, lease, now)
    check_succession(manifest, head)
