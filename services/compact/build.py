"""Build the spans that end at one head, from the deltas alone.

The worker keeps a follower directory (`clients.follower.Follower`) at the oldest base it
needs, `head - MAX_SPAN`; every tensor a delta of `(base, head]` touches is copied from it
once and walked forward through those deltas, each decoded against the tensor at its own
base (so every delta is verified by its digests on the way). The changes are composed
(`codec.compose`) into one patch per span and tensor, against a snapshot of the tensor at
the span's first version, and the result digest of every patch must be the tensor's
digest at head before anything leaves the worker. A span's patches travel in one blob.

Spans never cross a keyframe: a node that far behind bootstraps from the keyframe.
"""

from __future__ import annotations

import hashlib

import numpy as np

from deltaboard.board import codec
from deltaboard.board.contract.schemas import BlobRef, Manifest, TensorEntry
from deltaboard.board.contract.spans import SpanEntry, SpanManifest
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower.follower import Follower
from deltaboard.clients.follower.patcher import ShardMaps

MAX_SPAN = 32  # the longest span; see docs/design.md ("Spans") for the schedule


def span_bases(head: int, manifests: dict[int, Manifest]) -> list[int]:
    """First versions of the spans ending at `head`: head - 2, head - 4, ... head - MAX_SPAN,
    none below the last keyframe at or below head (`manifests` holds head - MAX_SPAN..head
    where they exist)."""
    keyframe = max((v for v, m in manifests.items() if m.kind == "full"), default=min(manifests))
    out, length = [], 2
    while length <= MAX_SPAN and head - length >= keyframe:
        out.append(head - length)
        length *= 2
    return out


def _tensor_walk(
    start: np.ndarray, dtype: str, steps: list[tuple[int, TensorEntry, bytes]], bases: list[int]
) -> tuple[dict[int, tuple[np.ndarray, str]], dict[int, list[codec.Changes]], str]:
    """Walk one tensor from `start` through its deltas: a snapshot (bytes, digest) at each
    base, the changes after each base, and the digest at the end."""
    tensor = start.copy()
    held = codec.digest(tensor, dtype)  # a full hash: the follower's copy is checked too
    snapshots: dict[int, tuple[np.ndarray, str]] = {}
    after: dict[int, list[codec.Changes]] = {a: [] for a in bases}
    pending = sorted(bases)
    for version, entry, patch in steps:
        while pending and pending[0] < version:
            snapshots[pending.pop(0)] = (tensor.copy(), held)
        changes = codec.decode(patch, tensor, held)  # checks the base and result digests
        if codec.read_header(patch).result_digest != entry.digest:
            raise codec.PatchError(f"version {version}: {entry.name} patch is not the manifest's")
        tensor.view(codec.uint_dtype(dtype))[changes.positions] = changes.new_bits
        held = entry.digest
        for a in bases:
            if a < version:
                after[a].append(changes)
    for a in pending:
        snapshots[a] = (tensor.copy(), held)
    return snapshots, after, held


def build_spans(
    client: BoardClient, run: str, follower: Follower, head: int
) -> list[tuple[SpanManifest, bytes]]:
    """The spans ending at `head` (with each one's blob), verified; none when head is
    too close to its keyframe."""
    lo = max(0, head - MAX_SPAN)
    manifests = {v: client.manifest(run, v) for v in range(lo, head + 1)}
    bases = span_bases(head, manifests)
    if not bases:
        return []
    oldest = min(bases)
    follower.sync(oldest)
    maps = ShardMaps(follower.model_dir, writable=False)
    blobs: dict[str, bytes] = {}
    touched: dict[str, list[tuple[int, TensorEntry, bytes]]] = {}
    for v in range(oldest + 1, head + 1):
        for entry in manifests[v].tensors:
            ref = entry.blob
            if ref.sha256 not in blobs:
                blobs[ref.sha256] = client.get_blob(run, ref.sha256)
            patch = blobs[ref.sha256][ref.offset : ref.offset + ref.length]
            touched.setdefault(entry.name, []).append((v, entry, patch))
    packed: dict[int, list[tuple[TensorEntry, bytes, str, int]]] = {a: [] for a in bases}
    try:
        for name, steps in touched.items():
            dtype = steps[-1][1].dtype
            snapshots, after, _ = _tensor_walk(maps.tensor(name), dtype, steps, bases)
            for a in bases:
                composed = codec.compose(after[a]) if after[a] else None
                if composed is None or not composed.count:
                    continue
                old, base_digest = snapshots[a]
                patch = codec.encode_changes(composed, old, dtype, old_digest=base_digest)
                if codec.read_header(patch).result_digest != steps[-1][1].digest:
                    raise codec.PatchError(f"span {a} -> {head}: {name} does not reach its digest at {head}")
                packed[a].append((steps[-1][1], patch, base_digest, composed.count))
    finally:
        maps.close()
    out = []
    for a in bases:
        data = b"".join(patch for _, patch, _, _ in packed[a])
        sha = hashlib.sha256(data).hexdigest()
        entries, offset = [], 0
        for entry, patch, base_digest, changed in packed[a]:
            layout = entry.model_dump(include={"name", "dtype", "shape", "file"})
            blob = BlobRef(sha256=sha, offset=offset, length=len(patch))
            entries.append(
                SpanEntry(**layout, blob=blob, digest=entry.digest, changed=changed, base_digest=base_digest)
            )
            offset += len(patch)
        span = SpanManifest(
            run=run,
            from_version=a,
            to_version=head,
            tensors=tuple(entries),
            base_state_digest=manifests[a].state_digest,
            state_digest=manifests[head].state_digest,
        )
        out.append((span, data))
    return out
