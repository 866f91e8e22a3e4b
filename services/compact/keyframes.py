"""Worker keyframes: every tensor of a head, whole, so that a new node starts near head.

The trainer sends a keyframe rarely (its upload per version stays one delta); without
one near head a new node would take the trainer's last keyframe and every step since.
When the board's bootstrap plan to a head starts `every` or more versions back, the worker
encodes the head's tensors from its follower copy (the codec's keyframe encoding, each
checked against the tensor's digest at head), in the layout's order, into one blob, and
registers them with each tensor's range, which a node fetches in parallel and checks as it
arrives (by the patch's checksum, then the digests; the `range_sha256` each entry still
carries is for followers that checked it). The board checks the digests against the
committed manifests and stores it create-if-absent, like a span.

Schedule: `every` = 32 by default, the longest span. A new node then takes one keyframe
plus at most the spans of the binary digits of its distance (each stored when its own
head came), and the board keeps the keyframes that some kept version's cheapest plan
takes (retention), so their storage stays about one keyframe per `every` kept versions.
"""

from __future__ import annotations

import hashlib

from deltaboard.board import codec
from deltaboard.board.contract.schemas import BlobRef
from deltaboard.board.contract.spans import KeyframeEntry, KeyframeManifest
from deltaboard.clients.follower.patcher import ShardMaps
from deltaboard.services.compact.build import SpanBuilder

KEYFRAME_EVERY = 32


def keyframe_due(builder: SpanBuilder, head: int, every: int) -> bool:
    """Whether a new node's plan to `head` starts `every` or more versions back."""
    plan = builder.client.plan(builder.run, None, head)
    return bool(plan.steps) and head - plan.steps[0].version >= every


def layout_order(builder: SpanBuilder, head: int) -> list[str]:
    """The tensors of `head`'s layout in the trainer keyframe's order (the first step of
    a bootstrap plan is that keyframe, or a worker keyframe listing them in that order)."""
    first = builder.client.plan(builder.run, None, head).steps[0]
    if first.kind == "keyframe":
        entries = builder.client.keyframe(builder.run, first.version).tensors
        return [t.name for t in entries]
    return list(dict.fromkeys(t.name for t in builder.client.manifest(builder.run, first.version).tensors))


def build_keyframe(builder: SpanBuilder, head: int) -> tuple[KeyframeManifest, bytes]:
    """The keyframe of `head` (with its blob), from the builder's follower copy at head
    (`builder.build(head)` first), each tensor checked against its digest at head."""
    window = builder.window
    if window is None or window.top != head:
        raise codec.PatchError(f"the worker's copy is not at version {head}")
    digests = window.digests[head]
    names = layout_order(builder, head)
    maps = ShardMaps(builder.follower.model_dir, writable=False)
    try:

        def one(name: str) -> bytes:
            patch = codec.encode(None, maps.tensor(name), maps.placements[name].dtype)
            if codec.read_header(patch).result_digest != digests[name]:
                raise codec.PatchError(f"keyframe {head}: {name} is not its digest at {head}")
            return patch

        patches = list(builder.pool.map(one, names))
        placements = [maps.placements[name] for name in names]
    finally:
        maps.close()
    data = b"".join(patches)
    sha = hashlib.sha256(data).hexdigest()
    entries, offset = [], 0
    for name, placement, patch in zip(names, placements, patches, strict=True):
        entries.append(
            KeyframeEntry(
                name=name,
                dtype=placement.dtype,
                shape=placement.shape,
                file=placement.file,
                blob=BlobRef(sha256=sha, offset=offset, length=len(patch)),
                digest=digests[name],
                changed=codec.read_header(patch).numel,
                range_sha256=hashlib.sha256(patch).hexdigest(),
            )
        )
        offset += len(patch)
    keyframe = KeyframeManifest(
        run=builder.run, version=head, tensors=tuple(entries), state_digest=window.states[head]
    )
    return keyframe, data
