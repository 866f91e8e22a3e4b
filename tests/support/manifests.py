"""Building and committing small synthetic versions for board tests (no codec needed:
the board treats blob contents as opaque bytes)."""

from __future__ import annotations

import hashlib
import time
from typing import Literal

from deltaboard.board.contract.schemas import BlobRef, Head, Manifest, ManifestStats, TensorEntry, ViewSpec
from deltaboard.clients.board_client import BoardClient


def manifest(
    run: str,
    version: int,
    epoch: int,
    payloads: dict[str, bytes],
    *,
    kind: Literal["full", "delta"] | None = None,
    meta: dict[str, object] | None = None,
) -> Manifest:
    """A manifest with one tensor per payload, each tensor a whole blob."""
    tensors = tuple(
        TensorEntry(
            name=name,
            dtype="U8",
            shape=(len(data),),
            file="model.safetensors",
            blob=BlobRef(sha256=hashlib.sha256(data).hexdigest(), offset=0, length=len(data)),
            digest="0" * 32,
            changed=len(data),
        )
        for name, data in sorted(payloads.items())
    )
    size = sum(len(d) for d in payloads.values())
    return Manifest(
        run=run,
        version=version,
        parent=None if version == 0 else version - 1,
        kind=kind or ("full" if version == 0 else "delta"),
        view=ViewSpec(),
        epoch=epoch,
        created_at=time.time(),
        meta=meta or {},
        tensors=tensors,
        state_digest="0" * 64,
        stats=ManifestStats(changed_elements=size, total_elements=size, encoded_bytes=size, view_bytes=size),
    )


def publish(
    client: BoardClient,
    run: str,
    version: int,
    epoch: int,
    payloads: dict[str, bytes],
    *,
    kind: Literal["full", "delta"] | None = None,
) -> Head:
    """Upload the payloads as blobs and commit them as `version`."""
    for data in payloads.values():
        client.upload_blob(run, data)
    return client.commit(run, manifest(run, version, epoch, payloads, kind=kind))
