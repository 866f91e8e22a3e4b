"""Retention: which versions and blobs a run may shed, and the deletion itself.

Keep the last `keep_last` versions and the keyframe chain the oldest of them needs (a node
can always bootstrap to any kept version), and the spans and worker keyframes that the
cheapest plan from a kept version (or from nothing) to head takes; the others go, with
their blobs. The trainer's chain stays even where a worker keyframe could replace it. A
blob goes only when no kept manifest or span (nor a manifest above head, which may be a
commit in flight) references it and it has been idle, i.e. neither uploaded nor claimed
by a deduplicated upload, for longer than the grace period; the grace period protects
uploads whose commit has not arrived yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from deltaboard.board.contract.schemas import Manifest, RetentionReport
from deltaboard.board.server.plan import cheapest
from deltaboard.board.server.records import VersionRecord, manifest_json
from deltaboard.board.server.spans import SpanEnds, SpanRecord
from deltaboard.board.server.storage import (
    ObjectNotFound,
    ObjectStore,
    blob_key,
    keyframe_key,
    manifest_key,
    manifest_prefix,
    manifest_version,
    span_key,
)


@dataclass(frozen=True)
class VersionSelection:
    keep: tuple[int, ...]
    delete: tuple[int, ...]
    keep_spans: tuple[SpanRecord, ...] = ()
    delete_spans: tuple[SpanRecord, ...] = ()


def select_versions(
    versions: Mapping[int, VersionRecord],
    head: int | None,
    keep_last: int,
    spans: Mapping[SpanEnds, SpanRecord] | None = None,
) -> VersionSelection:
    """Split committed versions, and stored spans, into kept and deleted (pure)."""
    spans = spans or {}
    if head is None or not versions:
        return VersionSelection(keep=tuple(sorted(versions)), delete=(), keep_spans=tuple(spans.values()))
    oldest_kept = max(head - keep_last + 1, min(versions))
    keyframes = [v for v, r in versions.items() if r.kind == "full" and v <= oldest_kept]
    if keyframes:
        oldest_kept = max(keyframes)
    keep = tuple(sorted(v for v in versions if v >= oldest_kept))
    delete = tuple(sorted(v for v in versions if v < oldest_kept))
    kept = {v: versions[v] for v in keep}
    usable = {
        ends: s
        for ends, s in spans.items()
        if (s.from_version if s.from_version is not None else s.to_version) >= oldest_kept
        and s.to_version <= head
    }
    needed: set[SpanEnds] = set()
    for start in (None, *keep):
        for step in cheapest(kept, usable, start, head) or ():
            if isinstance(step, SpanRecord):
                needed.add((step.from_version, step.to_version))
    return VersionSelection(
        keep=keep,
        delete=delete,
        keep_spans=tuple(spans[ends] for ends in sorted(needed, key=_order)),
        delete_spans=tuple(
            s for ends, s in sorted(spans.items(), key=lambda e: _order(e[0])) if ends not in needed
        ),
    )


def _order(ends: SpanEnds) -> tuple[int, int]:
    """Spans and worker keyframes (first version None) in order of their ends."""
    return (-1 if ends[0] is None else ends[0], ends[1])


def select_blobs(
    last_active: Mapping[str, float], referenced: set[str], now: float, grace_s: float
) -> tuple[str, ...]:
    """Blobs that are unreferenced and idle for longer than `grace_s` (pure)."""
    return tuple(sorted(sha for sha, t in last_active.items() if sha not in referenced and now - t > grace_s))


def apply_retention(
    store: ObjectStore,
    run: str,
    versions: Mapping[int, VersionRecord],
    head: int | None,
    selection: VersionSelection,
    grace_s: float,
    touches: Mapping[str, float],
    now: float,
) -> RetentionReport:
    """Delete the selected manifests, then the idle unreferenced blobs. The caller has
    already dropped the versions from the index, so no new plan names them."""
    referenced = {sha for v in selection.keep for sha in versions[v].blobs}
    referenced |= {sha for span in selection.keep_spans for sha in span.blobs}
    for info in store.list(manifest_prefix(run)):
        version = manifest_version(info.key)
        if version is not None and (head is None or version > head):
            # Possibly a commit in flight: its blobs stay.
            with contextlib.suppress(ObjectNotFound, ValidationError):
                referenced |= Manifest.model_validate_json(manifest_json(store.get(info.key))).blob_shas()
    for version in selection.delete:
        store.delete_record(manifest_key(run, version))
    for span in selection.delete_spans:
        if span.from_version is None:
            store.delete(keyframe_key(run, span.to_version))
        else:
            store.delete(span_key(run, span.from_version, span.to_version))
    prefix = blob_key(run, "")
    last_active = {
        info.key[len(prefix) :]: max(info.modified, touches.get(info.key[len(prefix) :], 0.0))
        for info in store.list(prefix)
    }
    doomed = select_blobs(last_active, referenced, now, grace_s)
    for sha in doomed:
        store.delete(blob_key(run, sha))
    return RetentionReport(
        deleted_manifests=selection.delete, deleted_blobs=len(doomed), kept_versions=selection.keep
    )
