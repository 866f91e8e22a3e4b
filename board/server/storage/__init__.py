"""Storage port: the object store that holds the durable truth (docs/contract.md section 3).

Adapters: `deltaboard.board.server.storage.local.LocalStore` (a directory, the embedded default) and
`deltaboard.board.server.storage.s3.S3Store` (any S3 endpoint through boto3). Manifests and the head and
lease records are written by create-if-absent and compare-and-set on a version tag, so
that several board replicas cannot lose each other's writes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class ObjectNotFound(KeyError):
    """The key does not exist."""


class PreconditionFailed(Exception):
    """A conditional write lost: the key exists (create-if-absent) or changed (compare-and-set)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float


class ObjectStore(Protocol):
    """Plain objects (blobs, assets, run.json) plus *records*: small objects that change by
    compare-and-set (head.json, lease.json, manifests, whose slot a fenced writer may have
    to take over). Records have their own methods because an adapter may store them
    differently (the S3 adapter keeps numbered generations, see `deltaboard.board.server.storage.s3`)."""

    def get(self, key: str) -> bytes:
        """The object's bytes; `ObjectNotFound` when absent."""
        ...

    def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        """Write the object; with `if_none_match`, only if absent (else `PreconditionFailed`)."""
        ...

    def read_record(self, key: str) -> tuple[bytes, str] | None:
        """The record's bytes and its version tag, None when absent."""
        ...

    def write_record(self, key: str, data: bytes, expected: str | None) -> str:
        """Compare-and-set: write if the record's version tag is `expected` (None: if absent),
        atomically even against other processes; returns the new tag, or raises
        `PreconditionFailed`."""
        ...

    def write_records(self, writes: Sequence[tuple[str, bytes, str | None]]) -> int:
        """`write_record` for each `(key, data, expected)` in order, stopping at the first
        that loses; returns how many were written. A commit writes its manifest and the
        head this way, so that a store may make them durable together (the local store
        appends them to the run's commit log in one synced write, then sets them)."""
        ...

    def delete_record(self, key: str) -> None: ...

    def put_file(self, key: str, path: Path) -> None:
        """Store a finished temporary file under `key` (replacing it) and consume the file."""
        ...

    def stat(self, key: str) -> ObjectInfo | None: ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Objects whose key starts with `prefix`, in lexicographic key order."""
        ...

    def delete(self, key: str) -> None: ...

    def local_path(self, key: str) -> Path | None:
        """A path the server may stream from, for stores on the local filesystem."""
        ...

    def presign_download(self, key: str, expires_s: int) -> str | None:
        """A URL to GET the object without the board, if the store has one."""
        ...

    def presign_upload(self, key: str, sha256: str, expires_s: int) -> tuple[str, dict[str, str]] | None:
        """A URL (and the headers to send) to PUT a blob without the board, if the store has
        one; the store itself must refuse bytes that do not hash to `sha256`."""
        ...

    def close(self) -> None:
        """The board stops: the local store syncs the files its logs cover and empties
        them, so that a board started after a clean stop has nothing to replay."""
        ...


def write_in_order(store: ObjectStore, writes: Sequence[tuple[str, bytes, str | None]]) -> int:
    """`ObjectStore.write_records` one record after another."""
    for written, (key, data, expected) in enumerate(writes):
        try:
            store.write_record(key, data, expected)
        except PreconditionFailed:
            return written
    return len(writes)


def run_key(run: str) -> str:
    return f"runs/{run}/run.json"


def head_key(run: str) -> str:
    return f"runs/{run}/head.json"


def lease_key(run: str) -> str:
    return f"runs/{run}/lease.json"


def asset_key(run: str, name: str) -> str:
    return f"runs/{run}/assets/{name}"


def blob_key(run: str, sha256: str) -> str:
    return f"runs/{run}/blobs/{sha256}"


def manifest_prefix(run: str) -> str:
    return f"runs/{run}/manifests/"


def manifest_key(run: str, version: int) -> str:
    return f"{manifest_prefix(run)}{version:012d}.json"


def span_prefix(run: str) -> str:
    return f"runs/{run}/spans/"


def span_key(run: str, from_version: int, to_version: int) -> str:
    """Spans are named by their ends: one span per pair, whoever builds it."""
    return f"{span_prefix(run)}{from_version:012d}-{to_version:012d}.json"


def keyframe_prefix(run: str) -> str:
    return f"runs/{run}/keyframes/"


def keyframe_key(run: str, version: int) -> str:
    """Worker keyframes are named by their version: one per version, whoever builds it."""
    return f"{keyframe_prefix(run)}{version:012d}.json"


def manifest_version(key: str) -> int | None:
    """The version a manifest key (or one of its record generations, `...json@gen`) names,
    None for other keys."""
    name = key.rsplit("/", 1)[-1].split("@", 1)[0]
    if "/manifests/" not in key or not name.endswith(".json") or not name[:-5].isdigit():
        return None
    return int(name[:-5])
