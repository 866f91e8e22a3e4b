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
from deltaboard.board.contract.schemas import Manifest, ManifestStats, TensorPart, ViewSpec
from deltaboard.board.contract.view_spec import plan_layout
from deltaboard.publisher.encode import RankVersion
from deltaboard.publisher.packer import TensorPart as PackedPart


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
    if any(r.slices for r in ranks):
        tensors, rows, digests = _sliced(ranks)
    else:
        tensors, rows, digests = _whole(ranks)
    placement = plan_layout(tensors, spec).placement
    meta = dict(proposal.meta)
    if proposal.step is not None:
        meta["step"] = proposal.step
    # format v2: the entries as columns, validated column by column in pydantic's core (no
    # object per entry: a model of 20,000 tensors)
    return Manifest.model_validate(
        {
            "run": run,
            "version": proposal.version,
            "parent": proposal.parent,
            "kind": proposal.kind,
            "view": spec,
            "epoch": epoch,
            "created_at": time.time(),
            "meta": meta,
            "tensors": _columns(rows, placement),
            "state_digest": codec.state_digest(digests.items()),
            "stats": ManifestStats(
                changed_elements=sum(r.changed_elements for r in ranks),
                total_elements=sum(r.total_elements for r in ranks),
                encoded_bytes=sum(p.length for r in ranks for p in r.parts),
                view_bytes=sum(r.view_bytes for r in ranks),
            ),
        }
    )


Tensors = list[tuple[str, str, tuple[int, ...]]]
Row = tuple[PackedPart, tuple[int, ...], str, TensorPart | None]
"""An entry but its file, which the layout of every tensor decides: the rank's packed
patch, the whole tensor's shape and digest, and the part of it the patch holds (None:
the whole tensor)."""


def _columns(rows: Sequence[Row], placement: Mapping[str, str]) -> dict[str, Any]:
    """`TensorColumns` of the entries (each blob's sha256 once, entries naming its index)."""
    blobs: dict[str, int] = {}
    blob = [blobs.setdefault(p.sha256, len(blobs)) for p, *_ in rows]
    parts = [part for *_, part in rows]
    return {
        "blobs": list(blobs),
        "name": [p.name for p, *_ in rows],
        "dtype": [p.dtype for p, *_ in rows],
        "shape": [shape for _, shape, _, _ in rows],
        "file": [placement[p.name] for p, *_ in rows],
        "blob": blob,
        "offset": [p.offset for p, *_ in rows],
        "length": [p.length for p, *_ in rows],
        "digest": [digest for _, _, digest, _ in rows],
        "changed": [p.changed for p, *_ in rows],
        "part": parts if any(part is not None for part in parts) else None,
    }


def _whole(ranks: Sequence[RankVersion]) -> tuple[Tensors, list[Row], dict[str, str]]:
    """Every rank's own whole tensors, in rank order."""
    tensors = [t for r in ranks for t in r.tensors]
    names = [name for name, _, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError("two ranks published a tensor of the same name: partition the state dict")
    rows: list[Row] = [(p, p.shape, p.digest, None) for r in ranks for p in r.parts]
    return tensors, rows, {n: d for r in ranks for n, d in r.digests.items()}


def _sliced(ranks: Sequence[RankVersion]) -> tuple[Tensors, list[Row], dict[str, str]]:
    """Slices of tensors from every rank: one entry per part, in the trainer's state order
    (then rank order); each tensor's digest is the combination of its slices' digests."""
    whole: dict[str, tuple[int, str, tuple[int, ...]]] = {}  # name: order, dtype, shape
    slice_digests: dict[str, list[str]] = {}
    for r in ranks:
        for name, dtype, _ in r.tensors:
            at = r.slices[name]
            seen = whole.setdefault(name, (at.order, dtype, at.tensor_shape))
            if seen != (at.order, dtype, at.tensor_shape):
                raise ValueError(
                    f"ranks disagree on tensor {name!r}: {seen} and {(at.order, dtype, at.tensor_shape)}"
                )
            slice_digests.setdefault(name, []).append(r.slice_digests[name])
    digests = {name: codec.combine_digests(found) for name, found in slice_digests.items()}
    ordered = sorted(whole.items(), key=lambda item: item[1][0])
    tensors = [(name, dtype, shape) for name, (_, dtype, shape) in ordered]
    placed: list[tuple[int, int, Row]] = []
    for rank, r in enumerate(ranks):
        for p in r.parts:
            at = r.slices[p.name]
            part = None
            if p.shape != at.tensor_shape:
                part = TensorPart(offset=at.offset, shape=p.shape, digest=r.slice_digests[p.name])
            placed.append((at.order, rank, (p, at.tensor_shape, digests[p.name], part)))
    return tensors, [row for _, _, row in sorted(placed, key=lambda x: x[:2])], digests
