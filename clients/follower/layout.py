"""Materialise a slot in the layout the publisher's view declares.

The shard files and the index JSON come from `deltaboard.board.contract.view_spec.plan_layout` over the
keyframe's tensors (the same rule the publisher used to fill each entry's `file`); inside
a shard, tensors follow the manifest's order. A new slot is created with each shard's
safetensors header and its data region allocated (zero-filled, sparse on disk); the
keyframe's tensors are then written through the mapping (`patcher.ShardMaps`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from deltaboard.board.contract.schemas import Manifest
from deltaboard.board.contract.view_spec import INDEX_FILE, nbytes, plan_layout
from deltaboard.clients.follower.errors import FollowerError
from deltaboard.clients.follower.patcher import HEADER_LEN

ALIGN = 8  # safetensors pads its header so that tensor data starts 8-byte aligned


def shard_header(entries: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, int]:
    """The safetensors prefix (length + JSON header) for tensors stored in this order, and
    the size of the data region after it."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        size = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(HEADER_LEN.size + len(text)) % ALIGN)
    return HEADER_LEN.pack(len(text)) + text, offset


def materialize(slot_dir: Path, keyframe: Manifest, assets: Mapping[str, bytes]) -> None:
    """Create the shard files (headers, allocated data), the index JSON and the assets of
    an empty slot for the keyframe's layout."""
    # a tensor sent in parts is listed once, where its first part is
    tensors = list({t.name: (t.name, t.dtype, t.shape) for t in keyframe.tensors}.values())
    layout = plan_layout(tensors, keyframe.view)
    wrong = [t.name for t in keyframe.tensors if layout.placement[t.name] != t.file]
    if wrong:
        raise FollowerError(
            f"version {keyframe.version} places {wrong[:3]} in files its view spec does not give them"
        )
    for file in layout.files:
        prefix, data_size = shard_header([t for t in tensors if layout.placement[t[0]] == file])
        with open(slot_dir / file, "wb") as f:
            f.write(prefix)
            f.truncate(len(prefix) + data_size)
    if layout.index is not None:
        (slot_dir / INDEX_FILE).write_text(json.dumps(layout.index, indent=2))
    for name, data in assets.items():
        path = slot_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
