"""A plan's span step, applied like a delta, and its keyframe step, applied like a full one.

The board's plan names a span (`board.contract.spans.SpanManifest`) from the version the
chain has reached to a later one. The follower reads it and the target version's own
manifest, checks that the span claims the target's state digest and starts where the
chain stands, and hands `apply_step` the target's manifest with the span's entries: each
patch must then decode against the digest the slot holds for its tensor (the span's base)
and reach the entry's digest, and the slot's state digest must be the target's, exactly as
for a delta. A span with wrong digests therefore fails like a bad delta blob.

A worker keyframe becomes its version's manifest as a keyframe: every tensor whole, each
decoded and checked against its digest, then the state digest, exactly as for the
trainer's keyframes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from deltaboard.board.contract.schemas import Manifest, TensorEntry
from deltaboard.board.contract.spans import KeyframeManifest, SpanManifest
from deltaboard.clients.follower.errors import FollowerError


def as_delta(span: SpanManifest, target: Manifest, base: int) -> Manifest:
    """`target` (the manifest of the span's last version) with the span's patches."""
    if (span.run, span.from_version, span.to_version) != (target.run, base, target.version):
        raise FollowerError(
            f"span {span.from_version}->{span.to_version} does not take {base} to {target.version}"
        )
    if span.state_digest != target.state_digest:
        raise FollowerError(f"span {span.from_version}->{span.to_version} does not end at the target's state")
    return _with_entries(target, "delta", base, span.tensors)


def as_full(keyframe: KeyframeManifest, target: Manifest) -> Manifest:
    """`target` (the manifest of the keyframe's version) as a keyframe with its entries."""
    if (keyframe.run, keyframe.version) != (target.run, target.version):
        raise FollowerError(
            f"keyframe {keyframe.run}@{keyframe.version} is not {target.run}@{target.version}"
        )
    if keyframe.state_digest != target.state_digest:
        raise FollowerError(f"keyframe {keyframe.version} does not hold the version's state")
    return _with_entries(target, "full", None, keyframe.tensors)


def _with_entries(
    target: Manifest, kind: Literal["full", "delta"], parent: int | None, derived: Sequence[TensorEntry]
) -> Manifest:
    """`target` as a step of `kind` from `parent` whose tensors are `derived`'s entries."""
    entries = tuple(TensorEntry(**e.model_dump(include=set(TensorEntry.model_fields))) for e in derived)
    stats = target.stats.model_copy(update={"changed_elements": sum(e.changed for e in entries)})
    return target.model_copy(update={"kind": kind, "parent": parent, "tensors": entries, "stats": stats})
