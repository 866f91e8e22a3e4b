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
and zstd release the GIL). Any failure is attributed to the blob that carried the bad
patch (`BadBlob`) so that the follower can discard and refetch exactly that blob.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from deltaboard.board import codec
from deltaboard.board.contract.schemas import Manifest, TensorEntry
from deltaboard.clients.follower.errors import FollowerError
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
        try:
            changes = _apply_entry(
                maps, manifest.kind, entry, blobs.read(entry.blob), digests.get(entry.name)
            )
        except codec.PatchError as exc:
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


def replay(maps: ShardMaps, written: list[Written], pool: Executor) -> bool:
    """Store already-verified changes into another slot at the same base, in order.

    Each tensor's current bits at the changed positions must be the changes' old bits
    (an O(changes) check that the slot is the base they were decoded against); returns
    False, having written nothing for that tensor, as soon as one is not.
    """

    def one(w: Written) -> bool:
        maps.prefault(w.name, w.changes.count)
        bits = maps.tensor(w.name).view(w.changes.new_bits.dtype)
        if not np.array_equal(bits[w.changes.positions], w.changes.old_bits):
            return False
        bits[w.changes.positions] = w.changes.new_bits
        return True

    # Changes to the same tensor from successive versions must land in order: one task per tensor.
    by_tensor: dict[str, list[Written]] = {}
    for w in written:
        by_tensor.setdefault(w.name, []).append(w)
    return all(run_all(pool, lambda ws: all(one(w) for w in ws), list(by_tensor.values())))


def run_all(pool: Executor, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """`fn` over `items` on `pool`; waits for every task before raising the first error,
    so that no write is still in flight when the caller handles it."""
    futures = [pool.submit(fn, item) for item in items]
    wait(futures)
    return [f.result() for f in futures]
