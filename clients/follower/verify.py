"""`deltaboard verify DIR`: re-hash every served tensor against the manifest.

Updates verify in O(changed elements) by carrying digests forward; this is the check that
does not trust that chain: it reads every byte of the served slot, recomputes each
tensor's digest, and compares the state digest over all of them with the manifest's (the
board's copy when a board is given, else the copy cached next to the slot). Tensors whose
digest differs from the one the journal recorded are named, to point at bit rot. It
takes no lock and only reads. Next to a live follower, a version committed while it runs
brings the slot being hashed forward under it, which reads as a mismatch: run it again
(or on a quiescent directory) before trusting one. `hash_tensors` and `damaged` are also
what `Follower.repair` (`verify --repair`, `pull --repair`) uses on both slots.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deltaboard.board import codec
from deltaboard.board.contract.schemas import Manifest
from deltaboard.board.contract.view_spec import INDEX_FILE
from deltaboard.clients.follower.errors import DirectoryError
from deltaboard.clients.follower.journal import Journal, SlotRecord
from deltaboard.clients.follower.manifests import ManifestCache
from deltaboard.clients.follower.patcher import ShardMaps
from deltaboard.clients.follower.slots import Slots


@dataclass
class VerifyReport:
    run: str
    version: int
    tensors: int = 0
    bytes: int = 0
    bad_tensors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_tensors and not self.problems


@dataclass(frozen=True)
class Served:
    """What a follower directory serves: run, version, slot directory, journal record."""

    run: str
    version: int
    slot_dir: Path
    record: SlotRecord
    manifest_dir: Path


def served(directory: Path) -> Served:
    """Read a follower directory's `current` link and journal (no lock, read-only)."""
    slots = Slots(directory)
    state = Journal(slots.journal_path).read()
    current = slots.current()
    record = None if state is None or current is None else state.slot(current)
    if state is None or current is None or record is None or record.version is None:
        raise DirectoryError(f"{directory} serves no version (not a follower directory, or not synced)")
    return Served(state.run, record.version, slots.slot_dir(current), record, slots.manifest_dir)


def hash_tensors(maps: ShardMaps, progress: Callable[[int], None] | None = None) -> dict[str, str]:
    """Every tensor's digest, recomputed from all of its bytes; `progress(n)` gets bytes hashed."""
    digests = {}
    for name, placement in maps.placements.items():
        digests[name] = codec.digest(maps.tensor(name), placement.dtype)
        if progress is not None:
            progress(placement.nbytes)
    return digests


def damaged(record: SlotRecord, digests: dict[str, str]) -> list[str]:
    """The tensors that do not hash to the digest `record` holds for them, or are missing."""
    bad = [name for name, value in digests.items() if record.digests.get(name) != value]
    return bad + sorted(set(record.digests) - set(digests))


def verify_directory(
    directory: Path, manifest: Manifest | None = None, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    """Re-hash the served slot of `directory` against `manifest` (default: the cached one).
    `progress(n)` receives the bytes hashed."""
    now = served(directory)
    run, version, record = now.run, now.version, now.record
    report = VerifyReport(run=run, version=version)
    if manifest is None:
        manifest = ManifestCache(now.manifest_dir, run).cached(version)
    if manifest is None:
        report.problems.append(f"no manifest of version {version} (cached copy missing and no board given)")
    elif (manifest.run, manifest.version) != (run, version):
        report.problems.append(f"the manifest is {manifest.run}@{manifest.version}, not {run}@{version}")
        manifest = None

    slot_dir = now.slot_dir
    maps = ShardMaps(slot_dir, writable=False)
    try:
        digests = hash_tensors(maps, progress)
    finally:
        maps.close()
    report.tensors = len(digests)
    report.bytes = sum(p.nbytes for p in maps.placements.values())
    report.bad_tensors = damaged(record, digests)
    if manifest is not None and codec.state_digest(digests.items()) != manifest.state_digest:
        report.problems.append(f"the state digest of the files is not the one of version {version}")
    index = slot_dir / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        where = {name: p.file for name, p in maps.placements.items()}
        if weight_map != where:
            report.problems.append(f"{INDEX_FILE} does not match the shard files")
    return report
