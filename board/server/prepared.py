"""Manifests a publisher prepared for its next commit (`POST .../prepare`), held in memory.

The commit of a model of many tensors spends most of its time on the manifest alone (for
20,000 tensors: ~2 MB of JSON parsed and validated, its rules, the stored JSON dumped and
compressed), and all of that is known before the version's last blob is uploaded. So a
publisher sends the manifest while that upload runs; the board checks and encodes it then,
and the commit names it (`CommitRequest.prepared`) and does only what needs the board's
state at that moment: fencing, succession, the blobs' sizes, the durable write.

Held by this process alone: a replica that did not prepare it, a restart, an expiry or an
eviction answers `UnknownPrepared`, and the publisher commits the manifest itself.
Nothing is stored, so a prepared manifest that is never committed leaves nothing behind.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from deltaboard.board.contract.errors import UnknownPrepared
from deltaboard.board.contract.schemas import Manifest
from deltaboard.board.server.clock import Clock
from deltaboard.board.server.records import encode, packed_manifest
from deltaboard.board.server.rules import check_manifest_shape

PREPARED_TTL_S = 120.0
PREPARED_ENTRIES = 8
# a 20,000-tensor manifest is ~2 MB of JSON and some 10 MB parsed: the JSON held is bounded
# too, so that a few manifests at the body limit (64 MiB) cannot take the board's memory
PREPARED_JSON_BYTES = 128 * 2**20


@dataclass(frozen=True)
class PreparedManifest:
    """A checked manifest (every rule it must satisfy on its own), its JSON as the board
    stores it and that JSON packed (`records.packed_manifest`)."""

    manifest: Manifest
    as_json: bytes
    packed: bytes

    @classmethod
    def of(cls, run: str, manifest: Manifest) -> PreparedManifest:
        """`manifest`, posted to `run`, checked on its own (`BadManifest`) and encoded:
        what every commit does first, at its prepare or in the commit itself."""
        check_manifest_shape(manifest, run)
        as_json = encode(manifest)
        return cls(manifest, as_json, packed_manifest(as_json))

    @property
    def name(self) -> str:
        """What a commit names it by: the sha256 of its stored JSON."""
        return hashlib.sha256(self.as_json).hexdigest()


class PreparedManifests:
    """At most `entries` prepared manifests of at most `json_bytes` of JSON together, each
    for `ttl_s` after it was prepared, the least recently prepared evicted first (a
    manifest larger than `json_bytes` alone is not held). Used from the event loop only
    (no lock)."""

    def __init__(
        self,
        clock: Clock,
        ttl_s: float = PREPARED_TTL_S,
        entries: int = PREPARED_ENTRIES,
        json_bytes: int = PREPARED_JSON_BYTES,
    ) -> None:
        self._clock = clock
        self.ttl_s = ttl_s
        self._entries = entries
        self._json_bytes = json_bytes
        self._held: OrderedDict[str, tuple[PreparedManifest, float]] = OrderedDict()
        self._bytes = 0

    def put(self, prepared: PreparedManifest) -> str:
        """Hold `prepared` (again: the same manifest prepared twice is one entry, its time
        renewed); returns its name."""
        name = prepared.name
        self.discard(name)
        self._held[name] = (prepared, self._clock.monotonic() + self.ttl_s)
        self._bytes += len(prepared.as_json)
        while len(self._held) > self._entries or self._bytes > self._json_bytes:
            self.discard(next(iter(self._held)))
        return name

    def get(self, run: str, name: str) -> PreparedManifest:
        """The manifest prepared for `run` under `name` (`UnknownPrepared` if none is held)."""
        found = self._held.get(name)
        if found is not None and found[1] <= self._clock.monotonic():
            self.discard(name)
            found = None
        if found is None or found[0].manifest.run != run:
            raise UnknownPrepared(
                f"no prepared manifest {name} for run {run!r} here (expired, evicted, or prepared "
                "on another board): commit the manifest itself"
            )
        return found[0]

    def discard(self, name: str) -> None:
        """Forget `name` (committed, expired or evicted)."""
        found = self._held.pop(name, None)
        if found is not None:
            self._bytes -= len(found[0].as_json)

    def __len__(self) -> int:
        return len(self._held)
