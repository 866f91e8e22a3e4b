"""Decode one version's delta into a `HotPatch`, against bytes equal to the served view.

The receiver of a hot update must decode each patch against the bits the engine serves
(the `context` encoding ranks positions within classes of the old values). Those bits
are on the host twice over: in the engine's memory for a CPU engine, and always in the
follower's served slot on disk, which holds the same version. `prepare_patch` takes the
base as a function from tensor name to its bytes, so either works.

The codec verifies every patch in O(changed elements): the patch's base digest must be
the one held for the tensor, and the decoded changes must take it to the patch's result
digest, which must be the manifest's. A keyframe is never a hot update.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor

import numpy as np

from deltaboard.board import codec
from deltaboard.board.contract.schemas import BlobRef, Manifest, TensorEntry
from deltaboard.clients.resident.errors import ResidentError
from deltaboard.clients.resident.patch import HotPatch

ReadBlob = Callable[[BlobRef], memoryview | bytes]
BaseBytes = Callable[[str], np.ndarray]


def prepare_patch(
    manifest: Manifest,
    read_blob: ReadBlob,
    base: BaseBytes,
    held_digests: Mapping[str, str],
    pool: Executor | None = None,
) -> HotPatch:
    """The verified changes that take the view at `manifest.parent` to `manifest.version`.

    `base(name)` gives a tensor's bytes at the parent (uint8), `held_digests` their
    digests. Raises `codec.PatchError` for a patch that does not verify (the caller may
    refetch its blob) and `ResidentError` for a keyframe or a tensor not held.
    """
    if manifest.kind != "delta" or manifest.parent is None:
        raise ResidentError(f"version {manifest.version} is a keyframe: it is loaded, not patched")
    if any(e.part is not None for e in manifest.tensors):
        # a part's patch covers a slice of its tensor; resident tensors are patched whole
        raise ResidentError(f"version {manifest.version} is published in parts: it is loaded, not patched")

    patches: list[tuple[TensorEntry, memoryview | bytes, str]] = []
    shapes: list[tuple[str, str, int, int]] = []
    for entry in manifest.tensors:
        held = held_digests.get(entry.name)
        if held is None:
            raise ResidentError(f"no digest held for tensor {entry.name!r}: the view is not at the parent")
        patch = read_blob(entry.blob)
        header = codec.read_header(patch)
        if header.result_digest != entry.digest:
            raise codec.PatchError(f"{entry.name}: patch result {header.result_digest} is not the manifest's")
        patches.append((entry, patch, held))
        shapes.append((entry.name, header.dtype, header.numel, header.changed))
    # each header says its changed count: the tensors decode straight into their places
    hot = HotPatch.allocate(manifest.parent, manifest.version, shapes)
    slots = dict(hot.slots())

    def one(item: tuple[TensorEntry, memoryview | bytes, str]) -> None:
        entry, patch, held = item
        changes = codec.decode(patch, base(entry.name), held)
        if changes.count:
            slots[entry.name].fill(changes.positions, changes.old_bits, changes.new_bits)

    if pool is not None:
        list(pool.map(one, patches))
    else:
        for item in patches:
            one(item)
    return hot
