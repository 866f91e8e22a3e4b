"""Assemble one manifest from the parts every rank produced.

Ranks encode and upload independently; the manifest is where their parts meet. The
shard files come from `deltaboard.board.contract.view_spec.plan_layout` over every tensor of every rank (in
rank order, then each rank's state-dict order), so a keyframe and the deltas after it
agree on where each tensor lives, and the state digest covers every tensor, changed or
not.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from deltaboard.board import codec
from deltaboard.board.contract.schemas import Manifest, ManifestStats, TensorEntry, ViewSpec
from deltaboard.board.contract.view_spec import plan_layout
from deltaboard.publisher.encode import RankVersion


@dataclass(frozen=True)
class Proposal:
    """The version every rank agreed to produce (all ranks derive it the same way)."""

    version: int
    kind: Literal["full", "delta"]
    step: int | None
    meta: Mapping[str, Any]

    @property
    def parent(self) -> int | None:
        return None if self.version == 0 else self.version - 1


def build_manifest(
    run: str, proposal: Proposal, spec: ViewSpec, epoch: int, ranks: Sequence[RankVersion]
) -> Manifest:
    tensors = [t for r in ranks for t in r.tensors]
    names = [name for name, _, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError("two ranks published a tensor of the same name: partition the state dict")
    layout = plan_layout(tensors, spec)
    meta = dict(proposal.meta)
    if proposal.step is not None:
        meta["step"] = proposal.step
    entries = tuple(
        TensorEntry(
            name=p.name,
            dtype=p.dtype,
            shape=p.shape,
            file=layout.placement[p.name],
            blob=p.blob,
            digest=p.digest,
            changed=p.changed,
        )
        for r in ranks
        for p in r.parts
    )
    return Manifest(
        run=run,
        version=proposal.version,
        parent=proposal.parent,
        kind=proposal.kind,
        view=spec,
        epoch=epoch,
        created_at=time.time(),
        meta=meta,
        tensors=entries,
        state_digest=codec.state_digest((n, d) for r in ranks for n, d in r.digests.items()),
        stats=ManifestStats(
            changed_elements=sum(r.changed_elements for r in ranks),
            total_elements=sum(r.total_elements for r in ranks),
            encoded_bytes=sum(p.blob.length for r in ranks for p in r.parts),
            view_bytes=sum(r.view_bytes for r in ranks),
        ),
    )
