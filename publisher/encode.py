"""Encode one rank's share of a version: keyframe or delta, patch by patch into blobs.

A keyframe encodes every tensor from its whole bytes (the only place the publisher moves
whole tensors to the host). A delta encodes only what `device_diff` found, and the
tensor's digest follows from the committed base's digest in O(changed elements)
(`digest_update`), so a delta never touches unchanged bytes on the host.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from board import codec
from publisher.device_diff import iter_diffs
from publisher.packer import BlobPacker, TensorPart
from publisher.snapshot import ViewBuffer


@dataclass(frozen=True)
class RankVersion:
    """What one rank contributes to a version (picklable: it is gathered to rank 0)."""

    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # every owned tensor: name, dtype, shape
    parts: tuple[TensorPart, ...]  # encoded tensors (all for a keyframe, changed ones for a delta)
    digests: Mapping[str, str]  # every owned tensor's digest after this version
    changed_elements: int
    total_elements: int
    view_bytes: int
    host_bytes: int  # bytes the diff moved from the device to the host
    diff_s: float  # time spent waiting for the diff, beyond what encoding hid (0 for keyframes)


def encode_rank(
    buffer: ViewBuffer,
    base: ViewBuffer | None,
    base_digests: Mapping[str, str],
    packer: BlobPacker,
) -> RankVersion:
    """Encode `buffer` as a keyframe (`base` None) or as a delta against `base`."""
    layout = buffer.layout
    slots = {s.name: s for s in layout.slots}
    tensors = tuple((s.name, s.dtype, s.shape) for s in layout.slots)
    total = sum(s.numel for s in layout.slots)
    digests = dict(base_digests)
    if base is None:
        for slot in layout.slots:
            patch = codec.keyframe(buffer.host_bytes(slot), slot.dtype)
            digests[slot.name] = codec.read_header(patch).result_digest
            packer.add(slot.name, slot.dtype, slot.shape, patch, digests[slot.name], slot.numel)
        return RankVersion(tensors, tuple(packer.finish()), digests, total, total, layout.view_bytes, 0, 0.0)
    changed = host_bytes = 0
    diff_s = 0.0
    started = time.perf_counter()
    for part in iter_diffs(base, buffer):
        diff_s += time.perf_counter() - started  # time waiting for the diff, not hidden by encoding
        for name, changes in part.changes.items():
            slot = slots[name]
            digests[name] = codec.digest_update(base_digests[name], changes)
            patch = codec.encode_changes(changes, None, slot.dtype, old_digest=base_digests[name])
            packer.add(name, slot.dtype, slot.shape, patch, digests[name], changes.count)
            changed += changes.count
        host_bytes += part.host_bytes
        started = time.perf_counter()
    parts = tuple(packer.finish())
    return RankVersion(tensors, parts, digests, changed, total, layout.view_bytes, host_bytes, diff_s)
