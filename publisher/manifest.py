"""Assemble one manifest from the parts every rank produced.

Ranks encode and upload independently; the manifest is where their parts meet. The
shard files come from `deltaboard.board.contract.view_spec.plan_layout` over every tensor of every rank (in
rank order, then each rank's state-dict order), so a keyframe and the deltas after it
agree on where each tensor lives, and the state digest covers every tensor, changed or
not.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import TypeAdapter

from deltaboard.board import codec
from deltaboard.board.contract.schemas import (
    Manifest,
    ManifestStats,
    TensorColumns,
    TensorPart,
    TensorTable,
    ViewSpec,
)
from deltaboard.board.contract.view_spec import plan_layout
from deltaboard.publisher.encode import RankVersion
from deltaboard.publisher.packer import PackedParts


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
        tensors, entries, digests = _sliced(ranks)
    else:
        tensors, entries, digests = _whole(ranks)
    placement, by_name = _planned(tensors, spec)
    meta = dict(proposal.meta)
    if proposal.step is not None:
        meta["step"] = proposal.step
    # format v2: the entries as columns (no object per entry: a model of 20,000 tensors),
    # taken as they are (`_columns`); the rest of the manifest is validated
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
            "tensors": TensorTable(_columns(entries, placement)),
            "state_digest": codec.sorted_state_digest(by_name, list(map(digests.__getitem__, by_name))),
            "stats": ManifestStats(
                changed_elements=sum(r.changed_elements for r in ranks),
                total_elements=sum(r.total_elements for r in ranks),
                encoded_bytes=sum(sum(r.parts.lengths) for r in ranks),
                view_bytes=sum(r.view_bytes for r in ranks),
            ),
        }
    )


Tensors = tuple[tuple[str, str, tuple[int, ...]], ...]


# The entry columns that follow from the caller's tensors (names, dtypes, shapes) and their
# layout (files), with the constraints `TensorColumns` puts on them.
def _column(name: str) -> TypeAdapter[Any]:
    annotation = TensorColumns.model_fields[name].annotation
    assert annotation is not None
    return TypeAdapter(annotation)


_LAYOUT_COLUMNS = {column: _column(column) for column in ("name", "dtype", "shape", "file")}


@functools.lru_cache(maxsize=4)
def _planned(tensors: Tensors, spec: ViewSpec) -> tuple[Mapping[str, str], list[str]]:
    """Each tensor's shard file, and the names sorted (as the state digest takes its
    entries): the same for every version of the same tensors, so made once for them (walks
    over every tensor, which a model of many tensors would pay per version). The tensors'
    names, dtypes, shapes and files are validated here, once, as the manifest's columns
    (`ValidationError`): a version's entries are some of these tensors."""
    placement = plan_layout(tensors, spec).placement
    names = [name for name, _, _ in tensors]
    for column, values in (
        ("name", names),
        ("dtype", [dtype for _, dtype, _ in tensors]),
        ("shape", [shape for _, _, shape in tensors]),
        ("file", [placement[name] for name in names]),
    ):
        _LAYOUT_COLUMNS[column].validate_python(values)
    return placement, sorted(names)


@dataclass(frozen=True)
class Entries:
    """The manifest's entries but their files, which the layout of every tensor decides:
    the packed patches, and per entry the whole tensor's shape and digest and the part of
    it the patch holds (None: the whole tensor), as columns."""

    packed: PackedParts
    shapes: list[tuple[int, ...]]
    digests: list[str]
    parts: list[TensorPart | None] | None  # None: every entry a whole tensor


def _columns(entries: Entries, placement: Mapping[str, str]) -> TensorColumns:
    """`TensorColumns` of the entries (each blob's sha256 once, entries naming its index),
    not validated again: what the caller gave (names, dtypes, shapes) and the files were
    validated once per set of tensors (`_planned`), and the rest is this publisher's own
    work (the codec's digests, the packer's blob ranges and counts), which the board
    validates on commit. Validated here too, every entry of every version would cost its
    time again, serially between the last upload and the board (a model of many small
    tensors pays it per entry)."""
    packed = entries.packed
    # two sealed blobs of the same bytes (identical tensors, in one packer or two ranks')
    # are one blob: the columns name each sha256 once
    index: dict[str, int] = {}
    renamed = [index.setdefault(sha, len(index)) for sha in packed.blobs]
    blob = packed.blob if len(index) == len(renamed) else [renamed[b] for b in packed.blob]
    return TensorColumns.model_construct(
        blobs=tuple(index),
        name=tuple(packed.names),
        dtype=tuple(packed.dtypes),
        shape=tuple(entries.shapes),
        file=tuple(map(placement.__getitem__, packed.names)),
        blob=tuple(blob),
        offset=tuple(packed.offsets),
        length=tuple(packed.lengths),
        digest=tuple(entries.digests),
        changed=tuple(packed.changed),
        part=None if entries.parts is None else tuple(entries.parts),
    )


def _whole(ranks: Sequence[RankVersion]) -> tuple[Tensors, Entries, Mapping[str, str]]:
    """Every rank's own whole tensors, in rank order."""
    if len(ranks) == 1:  # one state dict's names, unique (the layout's, as is)
        only = ranks[0]
        return only.tensors, Entries(only.parts, only.parts.shapes, only.parts.digests, None), only.digests
    tensors = tuple(t for r in ranks for t in r.tensors)
    names = [name for name, _, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError("two ranks published a tensor of the same name: partition the state dict")
    packed = PackedParts.joined([r.parts for r in ranks])
    entries = Entries(packed, packed.shapes, packed.digests, None)
    return tensors, entries, {n: d for r in ranks for n, d in r.digests.items()}


def _sliced(ranks: Sequence[RankVersion]) -> tuple[Tensors, Entries, Mapping[str, str]]:
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
    tensors = tuple((name, dtype, shape) for name, (_, dtype, shape) in ordered)
    joined = PackedParts.joined([r.parts for r in ranks])
    owners = [(rank, name) for rank, r in enumerate(ranks) for name in r.parts.names]
    keys = [(ranks[rank].slices[name].order, rank) for rank, name in owners]
    order = sorted(range(len(owners)), key=keys.__getitem__)
    shapes: list[tuple[int, ...]] = []
    parts: list[TensorPart | None] = []
    for i in order:
        rank, name = owners[i]
        at = ranks[rank].slices[name]
        shapes.append(at.tensor_shape)
        part = None
        if joined.shapes[i] != at.tensor_shape:
            part = TensorPart(
                offset=at.offset, shape=joined.shapes[i], digest=ranks[rank].slice_digests[name]
            )
        parts.append(part)
    packed = joined.take(order)
    whole_only = all(part is None for part in parts)
    entries = Entries(packed, shapes, [digests[name] for name in packed.names], None if whole_only else parts)
    return tensors, entries, digests
