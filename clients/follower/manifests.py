"""Manifests kept on local disk.

During an update, the chain's manifests are cached next to its blobs, so that a restart
after a kill does not fetch them again. Afterwards only the served version's manifest is
kept: `deltaboard verify` checks the directory against it without a board.

A manifest from the board is checked (`board.contract.manifest_rules.check_entries`)
before anything sizes a file or writes into one after it: one stored by an older, laxer
board may name an unknown dtype, a negative shape or a path for a file, and the follower
then stops with one `UnusableManifest` saying so.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from deltaboard.board.contract.errors import BadManifest, InvalidResponse
from deltaboard.board.contract.manifest_rules import check_entries
from deltaboard.board.contract.schemas import Manifest
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower.errors import FollowerError, UnusableManifest
from deltaboard.clients.follower.journal import atomic_write


class ManifestCache:
    def __init__(self, directory: Path, run: str) -> None:
        self.directory = directory
        self.run = run

    def _path(self, version: int) -> Path:
        return self.directory / f"{version:012d}.json"

    def cached(self, version: int) -> Manifest | None:
        """The cached manifest of `version`, or None (also for an unreadable file)."""
        try:
            manifest = Manifest.model_validate_json(self._path(version).read_bytes())
        except (FileNotFoundError, ValidationError):
            return None
        return manifest if (manifest.run, manifest.version) == (self.run, version) else None

    def get(self, board: BoardClient, version: int) -> Manifest:
        """The manifest of `version`, from the cache or the board (then cached)."""
        manifest = self.cached(version)
        if manifest is None:
            try:
                manifest = board.manifest(self.run, version)
                check_entries(manifest)
            except (InvalidResponse, BadManifest) as e:
                raise UnusableManifest(
                    f"the manifest of {self.run}@{version} is unusable: {e.message}"
                ) from e
            if (manifest.run, manifest.version) != (self.run, version):
                raise FollowerError(
                    f"the board answered {manifest.run}@{manifest.version} for {self.run}@{version}"
                )
            atomic_write(self._path(version), manifest.model_dump_json().encode())
        return manifest

    def keep_only(self, versions: set[int]) -> None:
        for path in self.directory.glob("*.json"):
            if not path.stem.isdigit() or int(path.stem) not in versions:
                path.unlink(missing_ok=True)
