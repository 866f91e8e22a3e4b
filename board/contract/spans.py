"""Derived data: span manifests (patches from version `from_version` to `to_version` of a
run) and worker keyframes (a committed version's whole tensors), both built by the
compaction worker from what the trainer published.

A span lists, for every tensor whose digest differs between the two versions, one codec
patch whose base is the tensor at `from_version` (`base_digest`) and whose result is the
tensor at `to_version` (`digest`), so that a follower applies it like a delta. It never
replaces the deltas: a board stores it beside them only after checking every digest
against the committed manifests of both ends (docs/contract.md §3), and a follower checks
the same digests again against what its slot holds.

A worker keyframe lists every tensor of a committed version whole, in the layout's order,
so that a new node starts there instead of at the trainer's last keyframe. Each entry also
carries the sha256 of its own byte range (`range_sha256`), which workers still write for
followers that check it; today's follower downloads the ranges in parallel and checks each
by its patch's own checksum and the trainer's digests, the end-to-end proof (docs/contract.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deltaboard.board.contract.schemas import Digest, RunName, Sha256, Strict, TensorEntry, Version

SPAN_FORMAT: Literal["deltaboard/span/v1"] = "deltaboard/span/v1"
KEYFRAME_FORMAT: Literal["deltaboard/keyframe/v1"] = "deltaboard/keyframe/v1"


class SpanEntry(TensorEntry):
    """One tensor's patch in a span: from `base_digest` (its digest at the span's first
    version) to `digest` (at its last). A span patches whole tensors (no `part`)."""

    base_digest: Digest


class SpanManifest(Strict):
    """The changes from `from_version` to `to_version` (at least two versions apart).
    `base_state_digest` and `state_digest` are the state digests of the two ends."""

    format: Literal["deltaboard/span/v1"] = SPAN_FORMAT
    run: RunName
    from_version: Version
    to_version: Version
    tensors: tuple[SpanEntry, ...]
    base_state_digest: Sha256
    state_digest: Sha256

    def blob_shas(self) -> set[str]:
        return {t.blob.sha256 for t in self.tensors}


class SpanRegistered(Strict):
    """The answer to a span registration: where it is, and whether this request stored it
    (False: an identical or equally verified span was there first)."""

    run: RunName
    from_version: Version
    to_version: Version
    manifest_url: str
    created: bool
    bytes: int = Field(ge=0)


class KeyframeEntry(TensorEntry):
    """One tensor of a worker keyframe: its keyframe encoding (the codec's `encode(None,
    ...)`), whole, and the sha256 of the blob's bytes in its range."""

    range_sha256: Sha256


class KeyframeManifest(Strict):
    """Every tensor of committed version `version`, whole; `state_digest` is the version's."""

    format: Literal["deltaboard/keyframe/v1"] = KEYFRAME_FORMAT
    run: RunName
    version: Version
    tensors: tuple[KeyframeEntry, ...]
    state_digest: Sha256

    def blob_shas(self) -> set[str]:
        return {t.blob.sha256 for t in self.tensors}


class KeyframeRegistered(Strict):
    """The answer to a keyframe registration (`created` False: one was there first)."""

    run: RunName
    version: Version
    manifest_url: str
    created: bool
    bytes: int = Field(ge=0)
