"""Records the board keeps in the object store next to manifests (docs/contract.md section 3),
plus the per-version summary the index caches for planning and retention.

They are internal to the board: clients see the wire models of `deltaboard.board.contract.schemas`.
A version's manifest is stored as its JSON in one zstd frame (`packed_manifest`); every
reader of the store takes it through `manifest_json`, which reads plain JSON too.
"""

from __future__ import annotations

from typing import Any, Literal

import zstandard
from pydantic import BaseModel, ConfigDict, Field

from deltaboard.board.contract.schemas import Head, Manifest, RunInfo, VersionSummary

_ZSTD_FRAME = b"\x28\xb5\x2f\xfd"  # how a zstd frame starts; a JSON record starts with "{"


def encode(model: BaseModel) -> bytes:
    """A record's stored bytes: its JSON."""
    return model.model_dump_json().encode()


def packed_manifest(as_json: bytes) -> bytes:
    """A manifest's JSON as the store holds it: one zstd frame. A model of many tensors
    has a manifest of megabytes whose columns repeat (20,000 entries: 2.19 MB of JSON,
    118 KB packed), and the commit writes and syncs it before it answers: 14 ms for the
    JSON on the dev machine's disk, 0.7 ms packed, where the run's commit log takes it."""
    return zstandard.ZstdCompressor(level=1).compress(as_json)


def served_manifest(stored: bytes) -> tuple[bytes, bytes]:
    """A stored manifest record as the board serves it: (its JSON, one zstd frame of that
    JSON). The frame is the record itself where it is one that decodes; an older board's
    plain JSON, or a damaged frame, is packed from the record as `manifest_json` reads it,
    so that a client which accepts zstd decodes what another client gets as JSON."""
    unpacked = _unpacked(stored)
    return (stored, packed_manifest(stored)) if unpacked is None else (unpacked, stored)


def manifest_json(stored: bytes) -> bytes:
    """A stored manifest's JSON: unpacked (`packed_manifest`), or as it is where an older
    board stored plain JSON. A frame that does not decode is returned as it is, to be
    refused as unreadable JSON by whoever parses it, as a damaged JSON record is."""
    unpacked = _unpacked(stored)
    return stored if unpacked is None else unpacked


def _unpacked(stored: bytes) -> bytes | None:
    """The JSON in a record that is a zstd frame which decodes; None for any other record."""
    if not stored.startswith(_ZSTD_FRAME):
        return None
    try:
        return zstandard.ZstdDecompressor().decompress(stored)
    except zstandard.ZstdError:
        return None


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunRecord(Record):
    """`runs/{run}/run.json`: what never changes about a run."""

    name: str
    created_at: float
    meta: dict[str, Any] = Field(default_factory=dict)

    def info(self, head: int | None, assets: tuple[str, ...]) -> RunInfo:
        return RunInfo(name=self.name, created_at=self.created_at, meta=self.meta, head=head, assets=assets)


class HeadRecord(Record):
    """`runs/{run}/head.json`: the committed head and the highest epoch ever granted.

    Granting a lease raises `epoch` here by compare-and-set, which invalidates the ETag a
    fenced writer read before its commit: its head CAS then fails (see `deltaboard.board.server.ledger`).
    """

    version: int | None = None
    kind: Literal["full", "delta"] | None = None
    epoch: int = 0

    def wire(self, run: str) -> Head:
        return Head(run=run, version=self.version, kind=self.kind, epoch=self.epoch)


class LeaseRecord(Record):
    """`runs/{run}/lease.json`: who may publish, with which epoch, until when."""

    holder: str
    epoch: int
    expires_at: float


class VersionRecord(Record):
    """What planning and retention need of a committed version: its kind, the sizes of
    the whole blobs it references (a node downloads whole blobs) and the stored size of
    its manifest (0 in records cached before it was counted)."""

    version: int
    kind: Literal["full", "delta"]
    blobs: dict[str, int]
    manifest_bytes: int = 0
    # What the operators' dashboard charts (`/v1/runs/{run}/versions`): the manifest's
    # change counts and creation time, and the board's commit latency. `commit_s` is known
    # only to the board that took the commit (None in records rebuilt from the store).
    changed_elements: int = 0
    total_elements: int = 0
    created_at: float = 0.0
    commit_s: float | None = None

    @classmethod
    def of(cls, manifest: Manifest, sizes: dict[str, int], manifest_bytes: int) -> VersionRecord:
        return cls(
            version=manifest.version,
            kind=manifest.kind,
            blobs={sha: sizes[sha] for sha in sorted(manifest.blob_shas())},
            manifest_bytes=manifest_bytes,
            changed_elements=manifest.stats.changed_elements,
            total_elements=manifest.stats.total_elements,
            created_at=manifest.created_at,
        )

    def summary(self) -> VersionSummary:
        total = self.total_elements
        return VersionSummary(
            version=self.version,
            kind=self.kind,
            bytes=sum(self.blobs.values()) + self.manifest_bytes,
            changed_fraction=self.changed_elements / total if total else 0.0,
            created_at=self.created_at,
            commit_s=self.commit_s,
        )


def head_rank(head: Head | HeadRecord | None) -> tuple[int, int]:
    """Order of head records: a newer version, or the same version under a newer epoch."""
    if head is None:
        return (-2, -2)
    return (-1 if head.version is None else head.version, -1 if head.epoch is None else head.epoch)
