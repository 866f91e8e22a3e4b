"""A plan's span step, applied like a delta.

The board's plan names a span (`board.contract.spans.SpanManifest`) from the version the
chain has reached to a later one. The follower reads it and the target version's own
manifest, checks that the span claims the target's state digest and starts where the
chain stands, and hands `apply_step` the target's manifest with the span's entries: each
patch must then decode against the digest the slot holds for its tensor (the span's base)
and reach the entry's digest, and the slot's state digest must be the target's, exactly as
for a delta. A span with wrong digests therefore fails like a bad delta blob.
"""

from __future__ import annotations

from deltaboard.board.contract.schemas import Manifest, TensorEntry
from deltaboard.board.contract.spans import SpanManifest
from deltaboard.clients.follower.errors import FollowerError


def as_delta(span: SpanManifest, target: Manifest, base: int) -> Manifest:
    """`target` (the manifest of the span's last version) with the span's patches."""
    if (span.run, span.from_version, span.to_version) != (target.run, base, target.version):
        raise FollowerError(
            f"span {span.from_version}->{span.to_version} does not take {base} to {target.version}"
        )
    if span.state_digest != target.state_digest:
        raise FollowerError(f"span {span.from_version}->{span.to_version} does not end at the target's state")
    entries = tuple(TensorEntry(**e.model_dump(exclude={"base_digest"})) for e in span.tensors)
    stats = target.stats.model_copy(update={"changed_elements": sum(e.changed for e in entries)})
    return target.model_copy(update={"kind": "delta", "parent": base, "tensors": entries, "stats": stats})
