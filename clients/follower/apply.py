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

Bringing the other slot forward (`replay`) writes the same changes again. Its base is
checked first, in O(changes) (`check_base`): its bits at the changed positions must be
the changes' old bits, which the digests verified in the staging slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from deltaboard.board import codec
from deltaboard.board.contract.schemas import Manifest, TensorEntry
from deltaboard.clients.follower.errors import CorruptBase, FollowerError
from deltaboard.clients.follower.fetch import BlobReader
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
    if kind == "full":
        maps.tensor(entry.name)[:] = codec.apply(None, patch)
        return None
    if held is None:
        raise FollowerError(f"no digest held for tensor {entry.name!r}: the slot is not at the parent")
    maps.prefault(entry.name, header.changed)
    changes = codec.decode(patch, maps.tensor(entry.name), held)
    maps.write_changes(entry.name, changes.positions, changes.new_bits)
    return changes


def apply_step(
    maps: ShardMaps,
    manifest: Manifest,
    blobs: BlobReader,
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

    for entry, changes in zip(manifest.tensors, run_all(pool, one, manifest.tensors), strict=True):
        digests[entry.name] = entry.digest
        if written is not None and changes is not None:
            written.append(Written(entry.name, changes))
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
