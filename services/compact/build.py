"""Build the spans that end at each head, incrementally from one head to the next.

The worker keeps a follower directory (`clients.follower.Follower`) at the last head it
built for, and in memory the changes of every delta of the last `MAX_SPAN` versions,
each decoded once, when its head arrived, against the tensor at its own base (so every
delta is verified by its digests on the way), plus every tensor's digest after each of
those versions. A new head then costs one delta's decode and the follower's one-delta
update, not a walk through the `MAX_SPAN` deltas again.

The spans of a head are composed nearest first: the span of 2 from the last two deltas,
each longer span from the span just built plus the deltas before it (`codec.compose` is
associative), so every delta's changes are composed once per head. Each span is encoded
against the tensor at its first version, rebuilt from the tensor at head by putting the
composed changes' old bits back (O(changes) on one copy per tensor), and the result digest
of every patch must be the tensor's digest at head before anything leaves the worker.
Tensors are independent and go to a thread pool. A span's patches travel in one blob.

Memory: the window's changes, ~`MAX_SPAN` x the changed fraction x (8 + 2 x the element
width) bytes per element of the view. The walk starts over from the board (a sync to the
oldest base, every tensor there hashed in full) when the worker starts, after a gap longer
than `MAX_SPAN` or at a keyframe.

Spans never cross a keyframe: a node that far behind bootstraps from the keyframe.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from deltaboard.board import codec
from deltaboard.board.contract.schemas import BlobRef, Manifest, TensorEntry
from deltaboard.board.contract.spans import SpanEntry, SpanManifest
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower.follower import Follower
from deltaboard.clients.follower.patcher import ShardMaps

MAX_SPAN = 32  # the longest span; see docs/design.md ("Spans") for the schedule


def span_bases(head: int, floor: int) -> list[int]:
    """First versions of the spans ending at `head`: head - 2, head - 4, ... head - MAX_SPAN,
    none below `floor` (no keyframe lies in (floor, head])."""
    out, length = [], 2
    while length <= MAX_SPAN and head - length >= floor:
        out.append(head - length)
        length *= 2
    return out


@dataclass
class Window:
    """What the worker holds between heads: the follower is at `top`; `changes[v]` are
    the decoded changes of delta v for v in (top - MAX_SPAN, top] (none at or below
    `floor`, where the walk started: the last keyframe, or MAX_SPAN before the head it
    started for, with no keyframe in between), `digests[v]` every tensor's digest and
    `states[v]` the state digest after version v, `layout` the latest entry of each tensor
    changed (dtype, shape, file)."""

    floor: int
    top: int
    states: dict[int, str]
    changes: dict[int, dict[str, codec.Changes]] = field(default_factory=dict)
    digests: dict[int, dict[str, str]] = field(default_factory=dict)
    layout: dict[str, TensorEntry] = field(default_factory=dict)


@dataclass(frozen=True)
class Patched:
    """One tensor's patch of one span."""

    entry: TensorEntry
    patch: bytes
    base_digest: str
    changed: int


class SpanBuilder:
    """Builds the spans of successive heads of one run (see the module docstring)."""

    def __init__(self, client: BoardClient, run: str, follower: Follower, threads: int | None = None) -> None:
        self.client = client
        self.run = run
        self.follower = follower
        self.window: Window | None = None
        self.pool = ThreadPoolExecutor(
            threads or os.cpu_count() or 1, thread_name_prefix="deltaboard-compact"
        )

    def close(self) -> None:
        self.pool.shutdown()

    def __enter__(self) -> SpanBuilder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self, head: int) -> list[tuple[SpanManifest, bytes]]:
        """The spans ending at `head` (with each one's blob), verified; none when head is
        too close to its keyframe. The follower is at `head` afterwards."""
        window = self.advance(head)
        bases = span_bases(head, window.floor)
        if not bases:
            return []
        names = list(dict.fromkeys(n for v in range(min(bases) + 1, head + 1) for n in window.changes[v]))
        maps = ShardMaps(self.follower.model_dir, writable=False)
        try:
            per_tensor = list(
                self.pool.map(lambda n: self._tensor_spans(window, maps, n, head, bases), names)
            )
        finally:
            maps.close()
        return [self._span(window, a, head, [p[a] for p in per_tensor if a in p]) for a in bases]

    # ---- the window ------------------------------------------------------------------

    def advance(self, head: int) -> Window:
        """Bring the window (and the follower) to `head`: the next deltas decoded onto it,
        or a fresh start when there is no window, a keyframe or a gap longer than MAX_SPAN."""
        window = self.window
        if window is not None and window.top == head:
            return window
        start = None if window is None or not window.top < head <= window.top + MAX_SPAN else window.top
        lo = max(0, head - MAX_SPAN) if start is None else start
        manifests = {v: self.client.manifest(self.run, v) for v in range(lo, head + 1)}
        keyframes = [v for v, m in manifests.items() if m.kind == "full" and (start is None or v > start)]
        if window is None or start is None or keyframes:
            window = self._restart(max(keyframes, default=lo), manifests)
        self._walk(window, [manifests[v] for v in range(window.top + 1, head + 1)])
        self.follower.sync(head)
        window.top = head
        for v in [v for v in window.changes if v <= head - MAX_SPAN]:
            del window.changes[v]
        for v in [v for v in window.digests if v < head - MAX_SPAN]:
            del window.digests[v], window.states[v]
        self.window = window
        return window

    def _restart(self, floor: int, manifests: dict[int, Manifest]) -> Window:
        """A window at `floor`: the follower synced there and every tensor hashed in full,
        which must give the manifest's state digest (the follower's copy is checked too)."""
        self.follower.sync(floor)
        maps = ShardMaps(self.follower.model_dir, writable=False)
        try:
            names = sorted(maps.placements)
            hashed = self.pool.map(lambda n: codec.digest(maps.tensor(n), maps.placements[n].dtype), names)
            digests = dict(zip(names, hashed, strict=True))
        finally:
            maps.close()
        state = manifests[floor].state_digest
        if codec.state_digest(digests.items()) != state:
            raise codec.PatchError(f"the worker's copy of version {floor} does not hash to its state digest")
        return Window(floor=floor, top=floor, states={floor: state}, digests={floor: digests})

    def _walk(self, window: Window, deltas: list[Manifest]) -> None:
        """Decode `deltas` (the versions after `window.top`, in order) against the tensors
        they change, walked forward in memory from the follower's copy at `window.top`."""
        blobs: dict[str, bytes] = {}
        touched: dict[str, list[tuple[int, TensorEntry, bytes]]] = {}
        for manifest in deltas:
            for entry in manifest.tensors:
                ref = entry.blob
                if ref.sha256 not in blobs:
                    blobs[ref.sha256] = self.client.get_blob(self.run, ref.sha256)
                patch = blobs[ref.sha256][ref.offset : ref.offset + ref.length]
                touched.setdefault(entry.name, []).append((manifest.version, entry, patch))
        held = window.digests[window.top]
        maps = ShardMaps(self.follower.model_dir, writable=False)
        try:
            walked = self.pool.map(lambda n: _tensor_walk(maps.tensor(n), held[n], touched[n]), list(touched))
            decoded = dict(zip(touched, walked, strict=True))
        finally:
            maps.close()
        digests = dict(held)
        for manifest in deltas:
            v = manifest.version
            window.changes[v] = {n: by_version[v] for n, by_version in decoded.items() if v in by_version}
            digests.update((t.name, t.digest) for t in manifest.tensors)
            window.layout.update((t.name, t) for t in manifest.tensors)
            window.digests[v] = dict(digests)
            window.states[v] = manifest.state_digest

    # ---- composing and encoding ------------------------------------------------------

    def _tensor_spans(
        self, window: Window, maps: ShardMaps, name: str, head: int, bases: list[int]
    ) -> dict[int, Patched]:
        """One tensor's patch of each span ending at `head` (none where it came back to
        its bits at the span's first version), nearest base first."""
        entry = window.layout[name].model_copy(update={"digest": window.digests[head][name]})
        dtype = entry.dtype
        current = maps.tensor(name)
        old = current.copy()
        bits, now = old.view(codec.uint_dtype(dtype)), current.view(codec.uint_dtype(dtype))
        out: dict[int, Patched] = {}
        composed: codec.Changes | None = None
        end = head
        for a in sorted(bases, reverse=True):
            chain = [window.changes[v][name] for v in range(a + 1, end + 1) if name in window.changes[v]]
            composed = (
                codec.compose(chain + ([composed] if composed is not None else [])) if chain else composed
            )
            end = a
            if composed is None or not composed.count:
                continue
            bits[composed.positions] = composed.old_bits  # the tensor at a, where it differs
            base_digest = window.digests[a][name]
            patch = codec.encode_changes(composed, old, dtype, old_digest=base_digest)
            bits[composed.positions] = now[composed.positions]  # back to head's bits
            if codec.read_header(patch).result_digest != entry.digest:
                raise codec.PatchError(f"span {a} -> {head}: {name} does not reach its digest at {head}")
            out[a] = Patched(entry, patch, base_digest, composed.count)
        return out

    def _span(self, window: Window, a: int, head: int, patched: list[Patched]) -> tuple[SpanManifest, bytes]:
        data = b"".join(p.patch for p in patched)
        sha = hashlib.sha256(data).hexdigest()
        entries, offset = [], 0
        for p in patched:
            layout = p.entry.model_dump(include={"name", "dtype", "shape", "file"})
            blob = BlobRef(sha256=sha, offset=offset, length=len(p.patch))
            entries.append(
                SpanEntry(
                    **layout, blob=blob, digest=p.entry.digest, changed=p.changed, base_digest=p.base_digest
                )
            )
            offset += len(p.patch)
        span = SpanManifest(
            run=self.run,
            from_version=a,
            to_version=head,
            tensors=tuple(entries),
            base_state_digest=window.states[a],
            state_digest=window.states[head],
        )
        return span, data


def _tensor_walk(
    start: np.ndarray, held: str, steps: list[tuple[int, TensorEntry, bytes]]
) -> dict[int, codec.Changes]:
    """Walk one tensor (a copy of `start`, whose digest is `held`) through its deltas in
    order; the changes of each, verified against the digests."""
    tensor = start.copy()
    out: dict[int, codec.Changes] = {}
    for version, entry, patch in steps:
        changes = codec.decode(patch, tensor, held)  # checks the base and result digests
        if codec.read_header(patch).result_digest != entry.digest:
            raise codec.PatchError(f"version {version}: {entry.name} patch is not the manifest's")
        tensor.view(codec.uint_dtype(entry.dtype))[changes.positions] = changes.new_bits
        held = entry.digest
        out[version] = changes
    return out
