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

import os
from collections.abc import Callable, Mapping
from concurrent.futures import Executor

import numpy as np

from deltaboard.board import codec
from deltaboard.board.codec.api import decode_payload
from deltaboard.board.codec.header import unpack
from deltaboard.board.contract.schemas import BlobRef, Manifest, TensorTable
from deltaboard.clients.resident.errors import ResidentError
from deltaboard.clients.resident.patch import HotPatch

ReadBlob = Callable[[BlobRef], memoryview | bytes]
BaseBytes = Callable[[str], np.ndarray]
_Patch = tuple[str, codec.PatchHeader, memoryview, str]  # name, header, payload, held digest
_BLOB_FIELDS = set(BlobRef.model_fields)
_SHARES = os.cpu_count() or 1


def prepare_patch(
    manifest: Manifest,
    read_blob: ReadBlob,
    base: BaseBytes,
    held_digests: Mapping[str, str],
    pool: Executor | None = None,
) -> HotPatch:
    """The verified changes that take the view at `manifest.parent` to `manifest.version`.

    `base(name)` gives a tensor's bytes at the parent (uint8), `held_digests` their
    digests. The tensors are decoded on `pool` in one share per core, each a loop over
    its tensors: one task per tensor cost more in the executor's locks and wake-ups than a
    small tensor's decode (an MoE view has tens of thousands). Raises `codec.PatchError`
    for a patch that does not verify (the caller may refetch its blob) and `ResidentError`
    for a keyframe or a tensor not held.
    """
    if manifest.kind != "delta" or manifest.parent is None:
        raise ResidentError(f"version {manifest.version} is a keyframe: it is loaded, not patched")
    # the manifest's columns, read as they are: no entry object per tensor
    table = TensorTable.of(manifest.tensors).columns
    if table.part is not None and any(p is not None for p in table.part):
        # a part's patch covers a slice of its tensor; resident tensors are patched whole
        raise ResidentError(f"version {manifest.version} is published in parts: it is loaded, not patched")

    patches: list[_Patch] = []
    shapes: list[tuple[str, str, int, int]] = []
    for name, blob, offset, length, digest in zip(
        table.name, table.blob, table.offset, table.length, table.digest, strict=True
    ):
        held = held_digests.get(name)
        if held is None:
            raise ResidentError(f"no digest held for tensor {name!r}: the view is not at the parent")
        ref = BlobRef.model_construct(_BLOB_FIELDS, sha256=table.blobs[blob], offset=offset, length=length)
        header, payload = unpack(read_blob(ref))
        if header.result_digest != digest:
            raise codec.PatchError(f"{name}: patch result {header.result_digest} is not the manifest's")
        patches.append((name, header, payload, held))
        shapes.append((name, header.dtype, header.numel, header.changed))
    # each header says its changed count: the tensors decode straight into their places
    hot = HotPatch.allocate(manifest.parent, manifest.version, shapes)
    slots = dict(hot.slots())

    def share(items: list[_Patch]) -> None:
        for name, header, payload, held in items:
            changes = decode_payload(header, payload, base(name), held)
            if changes.count:
                slots[name].fill(changes.positions, changes.old_bits, changes.new_bits)

    if pool is None or _SHARES == 1:
        share(patches)
    else:
        # every `_SHARES`-th tensor each: neighbours in a manifest are alike in size
        list(pool.map(share, (patches[i::_SHARES] for i in range(_SHARES))))
    return hot
