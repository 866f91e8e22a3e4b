"""Apply one version's manifest to a slot, verifying as it goes.

Delta step, per changed tensor: the patch header's result digest must be the manifest's;
`codec.decode` checks that the patch's base digest is the one the slot holds for that
tensor, decodes the changes and checks that they take it to the result digest
(`digest_update`, O(changed elements)) before a single byte is written; the changed
elements are then stored in place through the mapping. Keyframe step: every tensor is
decoded whole (the codec checks it with a full digest) and written into a freshly
materialised slot. After either, the state digest over all tensors must be the
manifest's. Verification therefore costs O(patch) for a delta, never O(model).

Tensors are independent, so they are decoded and written on a small thread pool (numpy
and zstd release the GIL). A failure is attributed to the blob that carried the bad patch
(`BadBlob`) so that the follower can discard and refetch exactly that blob, unless the
slot itself is to blame: the codec reads the old bits from the slot, so a damaged base
also fails the result digest. Only on that failure path is the tensor re-hashed in full;
if it no longer hashes to the digest its journal records, the error is `CorruptBase`
(refetching would not help).

A tensor sent in parts (a sharded trainer's slices, docs/contract.md "Parts") is assembled
in place: each keyframe part is written into its box of the tensor; each delta part is
decoded against its box, its positions moved to the whole tensor's, and the tensor's
digest (held digest plus every part's changes) must be the manifest's before any part is
written (`_check_parts`).

Bringing the other slot forward (`replay`) writes the same changes again. Its base is
checked first, in O(changes) (`check_base`): its bits at the changed positions must be
the changes' old bits, which the digests verified in the staging slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from deltaboard.board import codec
from deltaboard.board.contract.schemas import Manifest, TensorEntry
from deltaboard.clients.follower.errors import CorruptBase, FollowerError
from deltaboard.clients.follower.fetch import PatchSource
from deltaboard.clients.follower.patcher import ShardMaps

TensorProgress = Callable[[int], None]
T = TypeVar("T")
R = TypeVar("R")


class BadBlob(FollowerError):
    """A blob's patch did not decode or verify against the manifest and the slot."""

    def __init__(self, sha: str, message: str) -> None:
        super().__init__(f"blob {sha[:12]}: {message}")
        self.sha = sha


@dataclass(frozen=True)
class Written:
    """Changes stored into one tensor, kept to bring the other slot forward without decoding."""

    name: str
    changes: codec.Changes


def _check_entry(maps: ShardMaps, entry: TensorEntry) -> None:
    placement = maps.placements.get(entry.name)
    if placement is None:
        raise FollowerError(f"tensor {entry.name!r} is not in the keyframe's layout")
    if (placement.dtype, placement.shape) != (entry.dtype, tuple(entry.shape)):
        raise FollowerError(
            f"tensor {entry.name!r} is {entry.dtype}{list(entry.shape)} in the manifest but "
            f"{placement.dtype}{list(placement.shape)} in the keyframe's layout"
        )


def _apply_entry(
    maps: ShardMaps, kind: str, entry: TensorEntry, patch: memoryview, held: str | None
) -> codec.Changes | None:
    header = codec.read_header(patch)
    if header.result_digest != entry.digest:
        raise codec.PatchError(f"{entry.name}: patch result {header.result_digest} is not the manifest's")
    if kind == "full":  # decoded straight into the fresh slot: its pages are all written
        maps.prefault(entry.name, header.numel)
        codec.keyframe_into(patch, maps.tensor(entry.name))
        return None
    if held is None:
        raise FollowerError(f"no digest held for tensor {entry.name!r}: the slot is not at the parent")
    maps.prefault(entry.name, header.changed)
    changes = codec.decode(patch, maps.tensor(entry.name), held)
    maps.write_changes(entry.name, changes.positions, changes.new_bits)
    return changes


def _part_box(maps: ShardMaps, entry: TensorEntry) -> np.ndarray:
    """The elements of the slot's tensor that `entry`'s part covers: a strided view."""
    assert entry.part is not None
    whole = maps.tensor(entry.name).view(codec.uint_dtype(entry.dtype)).reshape(entry.shape)
    return whole[tuple(slice(o, o + n) for o, n in zip(entry.part.offset, entry.part.shape, strict=True))]


def _apply_part(maps: ShardMaps, kind: str, entry: TensorEntry, patch: memoryview) -> codec.Changes | None:
    """A keyframe part is decoded, checked against its slice digest and written into its
    box; a delta part is decoded against the box's bits and returned with positions in the
    whole tensor, unwritten: the tensor's digest is checked over all its parts first."""
    part = entry.part
    assert part is not None
    header = codec.read_header(patch)
    if header.numel != math.prod(part.shape):
        raise codec.PatchError(
            f"{entry.name}: patch of {header.numel} elements for a part of {list(part.shape)}"
        )
    box = _part_box(maps, entry)
    if kind == "full":
        data = codec.apply(None, patch)
        if codec.digest_slice(data, entry.dtype, part.offset, part.shape, entry.shape) != part.digest:
            raise codec.PatchError(f"{entry.name}: part at {list(part.offset)} is not the manifest's")
        box[...] = data.view(box.dtype).reshape(part.shape)
        return None
    old = np.ascontiguousarray(box).view(np.uint8).reshape(-1)  # a copy only for a strided box
    local = codec.decode(patch, old, header.base_digest)  # the tensor's digest vouches for the base
    positions = codec.slice_positions(local.positions, part.offset, part.shape, entry.shape)
    return codec.Changes(entry.dtype, math.prod(entry.shape), positions, local.old_bits, local.new_bits)


def _check_parts(
    manifest: Manifest, results: list[codec.Changes | None], digests: Mapping[str, str]
) -> dict[str, codec.Changes]:
    """Each tensor sent in parts must reach the manifest's digest: a keyframe's from its
    parts' digests (`combine_digests`), a delta's from the digest held plus its parts'
    changes at global positions (O(changes)). Returns a delta's changes by tensor."""
    parts: dict[str, list[tuple[TensorEntry, codec.Changes | None]]] = {}
    for entry, changes in zip(manifest.tensors, results, strict=True):
        if entry.part is not None:
            parts.setdefault(entry.name, []).append((entry, changes))
    merged: dict[str, codec.Changes] = {}
    for name, found in parts.items():
        first = found[0][0]
        if manifest.kind == "full":
            reached = codec.combine_digests(e.part.digest for e, _ in found if e.part is not None)
        else:
            merged[name] = _merge([c for _, c in found if c is not None])
            reached = codec.digest_update(digests[name], merged[name])
        if reached != first.digest:
            raise BadBlob(
                first.blob.sha256, f"version {manifest.version}: the parts of {name!r} do not add up"
            )
    return merged


def _merge(parts: list[codec.Changes]) -> codec.Changes:
    """One tensor's changes from those of its disjoint parts, positions increasing."""
    positions = np.concatenate([c.positions for c in parts])
    order = np.argsort(positions, kind="stable")
    old_bits = np.concatenate([c.old_bits for c in parts])[order]
    new_bits = np.concatenate([c.new_bits for c in parts])[order]
    return codec.Changes(parts[0].dtype, parts[0].numel, positions[order], old_bits, new_bits)


def apply_step(
    maps: ShardMaps,
    manifest: Manifest,
    blobs: PatchSource,
    digests: dict[str, str],
    pool: Executor,
    *,
    progress: TensorProgress | None = None,
    written: list[Written] | None = None,
) -> None:
    """Apply `manifest` to the slot behind `maps`, whose tensor digests are `digests`
    (updated in place to the new version's). Delta changes are appended to `written`."""

    def one(entry: TensorEntry) -> codec.Changes | None:
        _check_entry(maps, entry)
        held = digests.get(entry.name)
        try:
            if entry.part is not None and manifest.kind != "full" and held is None:
                raise FollowerError(
                    f"no digest held for tensor {entry.name!r}: the slot is not at the parent"
                )
            if entry.part is not None:
                changes = _apply_part(maps, manifest.kind, entry, blobs.read(entry.blob))
            else:
                changes = _apply_entry(maps, manifest.kind, entry, blobs.read(entry.blob), held)
        except codec.PatchError as exc:
            if manifest.kind != "full" and held is not None and _hash(maps, entry.name) != held:
                raise CorruptBase(
                    f"{maps.slot_dir}: tensor {entry.name!r} does not hash to the digest its "
                    f"journal records, so version {manifest.version} cannot be applied to it",
                    [entry.name],
                ) from exc
            raise BadBlob(entry.blob.sha256, f"version {manifest.version}: {exc}") from exc
        if progress is not None:
            progress(1)
        return changes

    results = run_all(pool, one, manifest.tensors)
    in_parts = _check_parts(manifest, results, digests)
    run_all(pool, lambda c: maps.write_changes(c[0], c[1].positions, c[1].new_bits), list(in_parts.items()))
    for entry, changes in zip(manifest.tensors, results, strict=True):
        digests[entry.name] = entry.digest
        if written is not None and changes is not None and entry.part is None:
            written.append(Written(entry.name, changes))
    if written is not None:
        written.extend(Written(name, changes) for name, changes in in_parts.items())
    if manifest.kind == "full" and set(digests) != set(maps.placements):
        raise FollowerError(f"keyframe {manifest.version} does not cover every tensor of its layout")
    if codec.state_digest(digests.items()) != manifest.state_digest:
        raise FollowerError(f"version {manifest.version}: the state digest of the slot does not match")


def _hash(maps: ShardMaps, name: str) -> str:
    return codec.digest(maps.tensor(name), maps.placements[name].dtype)


def _by_tensor(written: list[Written]) -> dict[str, list[Written]]:
    """Changes grouped by tensor, each tensor's in the order they were written."""
    by_tensor: dict[str, list[Written]] = {}
    for w in written:
        by_tensor.setdefault(w.name, []).append(w)
    return by_tensor


def _first_old_bits(ws: list[Written]) -> tuple[np.ndarray, np.ndarray]:
    """Positions changed by successive versions of one tensor and, at each, the bits
    before the first change: what a slot at the chain's base holds there."""
    if len(ws) == 1:
        return ws[0].changes.positions, ws[0].changes.old_bits
    positions = np.concatenate([w.changes.positions for w in ws])
    old_bits = np.concatenate([w.changes.old_bits for w in ws])
    unique, first = np.unique(positions, return_index=True)
    return unique, old_bits[first]


def check_base(maps: ShardMaps, written: list[Written], pool: Executor) -> list[str]:
    """The tensors of the slot behind `maps` whose bits at the changed positions are not
    the changes' old bits: it does not hold the base `written` was decoded against.

    Reads O(changes) elements and writes nothing; `replay` may follow once it is empty.
    """
    groups = list(_by_tensor(written).items())

    def one(group: tuple[str, list[Written]]) -> bool:
        name, ws = group
        positions, old_bits = _first_old_bits(ws)
        maps.prefault(name, positions.size)  # the replay writes these pages next
        return np.array_equal(maps.tensor(name).view(old_bits.dtype)[positions], old_bits)

    return [name for (name, _), ok in zip(groups, run_all(pool, one, groups), strict=True) if not ok]


def replay(maps: ShardMaps, written: list[Written], pool: Executor) -> None:
    """Store already-verified changes into another slot at the same base (checked with
    `check_base`), in order: successive versions' changes to one tensor land in turn."""

    def one(ws: list[Written]) -> None:
        for w in ws:
            maps.write_changes(w.name, w.changes.positions, w.changes.new_bits)

    run_all(pool, one, list(_by_tensor(written).values()))


def run_all(pool: Executor, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """`fn` over `items` on `pool`; waits for every task before raising the first error,
    so that no write is still in flight when the caller handles it."""
    futures = [pool.submit(fn, item) for item in items]
    wait(futures)
    return [f.result() for f in futures]
