"""What a manifest must satisfy beyond the form its schema checks: pure rules, no I/O.

A manifest comes from a publisher that the board trusts only as far as its token, and a
follower acts on every field: it sizes files from dtypes and shapes, names files after
`file`, and reads blob ranges. So the board checks a manifest whole before it commits it
(`check_manifest`, refused with `BadManifest` naming the field), and a follower checks the
entries of one it received (`check_entries`) before it touches its disk, in case the board
that stored it was older and laxer.
"""

from __future__ import annotations

import math
import re

from deltaboard.board.contract.errors import BadManifest
from deltaboard.board.contract.schemas import Manifest
from deltaboard.board.contract.view_spec import DTYPE_WIDTHS, nbytes, plan_layout

# Far above any real tensor, far below what a follower's filesystem refuses.
MAX_TENSOR_BYTES = 2**40
# The shard files of the view rules (`view_spec.plan_layout`): nothing else is a file name.
SHARD_FILE_RE = re.compile(r"model(?:-(\d{5})-of-(\d{5}))?\.safetensors")


def _refuse(field: str, problem: str) -> BadManifest:
    return BadManifest(f"{field}: {problem}", field=field)


def _shard_file(name: str) -> bool:
    found = SHARD_FILE_RE.fullmatch(name)
    if found is None:
        return False
    if found.group(1) is None:
        return True
    k, n = int(found.group(1)), int(found.group(2))
    return 1 <= k <= n


def check_entries(manifest: Manifest) -> None:
    """Each tensor entry on its own: a known dtype, a shape of non-negative dimensions
    within `MAX_TENSOR_BYTES`, no more changed elements than it has, and a shard file
    name of the view rules (so no separators and no `..`)."""
    for i, entry in enumerate(manifest.tensors):
        at = f"tensors[{i}]"
        if entry.dtype not in DTYPE_WIDTHS:
            raise _refuse(f"{at}.dtype", f"{entry.dtype!r} is not one of {', '.join(DTYPE_WIDTHS)}")
        if any(d < 0 for d in entry.shape):
            raise _refuse(f"{at}.shape", f"{list(entry.shape)} has a negative dimension")
        if nbytes(entry.dtype, entry.shape) > MAX_TENSOR_BYTES:
            raise _refuse(f"{at}.shape", f"{list(entry.shape)} exceeds {MAX_TENSOR_BYTES} bytes")
        if entry.changed > math.prod(entry.shape):
            elements = math.prod(entry.shape)
            raise _refuse(f"{at}.changed", f"{entry.changed} exceeds the tensor's {elements} elements")
        if not _shard_file(entry.file):
            raise _refuse(f"{at}.file", f"{entry.file!r} is not a shard file name of the view rules")


def check_stats(manifest: Manifest) -> None:
    """The stats add up over the entries; a keyframe lists every tensor, so its layout is
    the view rules' and its totals are exactly its entries'."""
    stats = manifest.stats
    changed = sum(t.changed for t in manifest.tensors)
    if stats.changed_elements != changed:
        raise _refuse("stats.changed_elements", f"{stats.changed_elements}, the entries change {changed}")
    encoded = sum(t.blob.length for t in manifest.tensors)
    if stats.encoded_bytes != encoded:
        raise _refuse("stats.encoded_bytes", f"{stats.encoded_bytes}, the entries' blob ranges are {encoded}")
    elements = sum(math.prod(t.shape) for t in manifest.tensors)
    view_bytes = sum(nbytes(t.dtype, t.shape) for t in manifest.tensors)
    full = manifest.kind == "full"
    for field, stated, held in (
        ("stats.total_elements", stats.total_elements, elements),
        ("stats.view_bytes", stats.view_bytes, view_bytes),
    ):
        if full and stated != held:
            raise _refuse(field, f"{stated}, the keyframe's entries hold {held}")
        if stated < held:
            raise _refuse(field, f"{stated}, less than the entries' {held}")
    if full:
        layout = plan_layout([(t.name, t.dtype, t.shape) for t in manifest.tensors], manifest.view)
        for i, entry in enumerate(manifest.tensors):
            placed = layout.placement[entry.name]
            if placed != entry.file:
                raise _refuse(f"tensors[{i}].file", f"{entry.file!r}, the view rules place it in {placed!r}")


def check_manifest(manifest: Manifest) -> None:
    """Everything a manifest must satisfy on its own (`BadManifest` naming the field)."""
    check_entries(manifest)
    check_stats(manifest)
