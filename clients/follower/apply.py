"""Apply one version's manifest to a slot, verifying as it goes.

Delta step, per changed tensor: the patch header's result digest must be the manifest's;
`codec.decode` checks that the patch's base digest is the one the slot holds for that
tensor, decodes the changes and checks that they take it to the result digest
(`digest_update`, O(changed elements)) before a single byte is written; the changed
elements are then stored in place through the mapping. Keyframe step: every tensor is
decoded whole (the codec checks it with a full digest) and written into a freshly
materialised slot. After either, the state digest over all tensors must be the
manifest's. Verification therefore costs O(patch) for a delta, never O(model).

Any failure is attributed to the blob that carried the bad patch (`BadBlob`) so that the
follower can discard and refetch exactly that blob.
"""

from __future__ import annotations

from collections.abc import Callable

from board import codec
from board.schemas import Manifest, TensorEntry
from clients.follower.errors import FollowerError
from clients.follower.fetch import BlobReader
from clients.follower.patcher import ShardMaps

TensorProgress = Callable[[int], None]


class BadBlob(FollowerError):
    """A blob's patch did not decode or verify against the manifest and the slot."""

    def __init__(self, sha: str, message: str) -> None:
        super().__init__(f"blob {sha[:12]}: {message}")
        self.sha = sha


def _check_entry(maps: ShardMaps, entry: TensorEntry) -> None:
    placement = maps.placements.get(entry.name)
    if placement is None:
        raise FollowerError(f"tensor {entry.name!r} is not in the keyframe's layout")
    if (placement.dtype, placement.shape) != (entry.dtype, tuple(entry.shape)):
        raise FollowerError(
            f"tensor {entry.name!r} is {entry.dtype}{list(entry.shape)} in the manifest but "
            f"{placement.dtype}{list(placement.shape)} in the keyframe's layout"
        )


def _apply_delta(maps: ShardMaps, entry: TensorEntry, patch: memoryview, held: str | None) -> None:
    if held is None:
        raise FollowerError(f"no digest held for tensor {entry.name!r}: the slot is not at the parent")
    header = codec.read_header(patch)
    if header.result_digest != entry.digest:
        raise codec.PatchError(f"{entry.name}: patch result {header.result_digest} is not the manifest's")
    changes = codec.decode(patch, maps.tensor(entry.name), held)
    maps.write_changes(entry.name, changes.positions, changes.new_bits)


def _apply_full(maps: ShardMaps, entry: TensorEntry, patch: memoryview) -> None:
    header = codec.read_header(patch)
    if header.result_digest != entry.digest:
        raise codec.PatchError(f"{entry.name}: keyframe digest {header.result_digest} is not the manifest's")
    maps.tensor(entry.name)[:] = codec.apply(None, patch)


def apply_step(
    maps: ShardMaps,
    manifest: Manifest,
    blobs: BlobReader,
    digests: dict[str, str],
    progress: TensorProgress | None = None,
) -> None:
    """Apply `manifest` to the slot behind `maps`, whose tensor digests are `digests`
    (updated in place to the new version's)."""
    for entry in manifest.tensors:
        _check_entry(maps, entry)
        patch = blobs.read(entry.blob)
        try:
            if manifest.kind == "full":
                _apply_full(maps, entry, patch)
            else:
                _apply_delta(maps, entry, patch, digests.get(entry.name))
        except codec.PatchError as exc:
            raise BadBlob(entry.blob.sha256, f"version {manifest.version}: {exc}") from exc
        digests[entry.name] = entry.digest
        if progress is not None:
            progress(1)
    if manifest.kind == "full" and set(digests) != set(maps.placements):
        raise FollowerError(f"keyframe {manifest.version} does not cover every tensor of its layout")
    if codec.state_digest(digests.items()) != manifest.state_digest:
        raise FollowerError(f"version {manifest.version}: the state digest of the slot does not match")
