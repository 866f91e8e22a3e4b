"""The board's span and worker keyframe use cases: register one after checking it
against the committed manifests, read one back, and know a run's for planning.

Spans are derived data (docs/contract.md §3): the store holds them beside the manifests
(`runs/{run}/spans/{from}-{to}.json` and `runs/{run}/keyframes/{version}.json`,
create-if-absent), and this board keeps what it read
or registered in memory for plans, loading a run's spans from the store on first use. A
span registered through another board is seen after a restart; until then plans simply
do without it (a span only ever saves bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltaboard.board.contract.errors import BadManifest, UnknownVersion
from deltaboard.board.contract.schemas import Manifest
from deltaboard.board.contract.spans import KeyframeManifest, KeyframeRegistered, SpanManifest, SpanRegistered
from deltaboard.board.server.rules import check_blob_ranges
from deltaboard.board.server.spans import (
    SpanEnds,
    SpanRecord,
    check_keyframe,
    check_span,
    keyframe_url,
    span_url,
)

if TYPE_CHECKING:
    from deltaboard.board.server.service import BoardService


class SpanBook:
    """Spans of every run this board serves (see the module docstring)."""

    def __init__(self, service: BoardService) -> None:
        self.service = service
        self._records: dict[str, dict[SpanEnds, SpanRecord]] = {}

    async def _chain(self, run: str, first: int, last: int) -> list[Manifest]:
        """The committed manifests from the last trainer keyframe at or below `first` up
        to `last`."""
        current = await self.service.head(run)
        if current.version is None or last > current.version:
            raise UnknownVersion(f"version {last} is not committed (head {current.version})")
        versions = await self.service.index.versions(run)
        keyframes = [v for v, r in versions.items() if r.kind == "full" and v <= first]
        if not keyframes:
            raise BadManifest(f"no keyframe at or below version {first} is kept")
        return [
            Manifest.model_validate_json(await self.service.manifest(run, v))
            for v in range(max(keyframes), last + 1)
        ]

    async def _store(
        self, run: str, derived: SpanManifest | KeyframeManifest, sizes: dict[str, int | None]
    ) -> tuple[bytes, bool]:
        """Store checked derived data create-if-absent and record what is stored."""
        check_blob_ranges(derived, sizes)
        ledger = self.service.ledger
        if isinstance(derived, KeyframeManifest):
            data, created = await self.service.blocking(ledger.put_keyframe, run, derived)
            stored: SpanManifest | KeyframeManifest = (
                derived if created else KeyframeManifest.model_validate_json(data)
            )
        else:
            data, created = await self.service.blocking(ledger.put_span, run, derived)
            stored = derived if created else SpanManifest.model_validate_json(data)
        record = SpanRecord.of(stored, sizes, len(data))
        (await self.records(run))[(record.from_version, record.to_version)] = record
        return data, created

    async def _sizes(self, run: str, span: SpanManifest | KeyframeManifest) -> dict[str, int | None]:
        ledger = self.service.ledger
        return {sha: await self.service.blocking(ledger.blob_size, run, sha) for sha in span.blob_shas()}

    async def register(self, run: str, span: SpanManifest) -> SpanRegistered:
        """Check `span` (`BadManifest`, `MissingBlobs`) and store it unless a span with the
        same ends is stored already (that one stands: it passed the same checks)."""
        await self.service.require_run(run)
        check_span(span, run, await self._chain(run, span.from_version, span.to_version))
        data, created = await self._store(run, span, await self._sizes(run, span))
        return SpanRegistered(
            run=run,
            from_version=span.from_version,
            to_version=span.to_version,
            manifest_url=span_url(run, span.from_version, span.to_version),
            created=created,
            bytes=len(data),
        )

    async def register_keyframe(self, run: str, keyframe: KeyframeManifest) -> KeyframeRegistered:
        """Check a worker keyframe (`BadManifest`, `MissingBlobs`) and store it unless one
        of the same version is stored already (that one stands)."""
        await self.service.require_run(run)
        check_keyframe(keyframe, run, await self._chain(run, keyframe.version, keyframe.version))
        data, created = await self._store(run, keyframe, await self._sizes(run, keyframe))
        return KeyframeRegistered(
            run=run,
            version=keyframe.version,
            manifest_url=keyframe_url(run, keyframe.version),
            created=created,
            bytes=len(data),
        )

    async def keyframe(self, run: str, version: int) -> bytes:
        await self.service.require_run(run)
        data = await self.service.blocking(self.service.ledger.keyframe_bytes, run, version)
        if data is None:
            raise UnknownVersion(f"no worker keyframe of version {version} is stored")
        return data

    async def manifest(self, run: str, from_version: int, to_version: int) -> bytes:
        await self.service.require_run(run)
        data = await self.service.blocking(self.service.ledger.span_bytes, run, from_version, to_version)
        if data is None:
            raise UnknownVersion(f"no span {from_version} -> {to_version} is stored")
        return data

    async def records(self, run: str, *, reload: bool = False) -> dict[SpanEnds, SpanRecord]:
        """The run's spans and worker keyframes by their ends, loaded from the store on
        first use or when asked (retention does: a span another replica stored must keep
        its blobs)."""
        known = self._records.get(run)
        if known is None or reload:
            ledger = self.service.ledger
            known = {}
            stored: list[tuple[SpanManifest | KeyframeManifest, int]] = [
                *await self.service.blocking(ledger.spans, run),
                *await self.service.blocking(ledger.keyframes, run),
            ]
            for derived, size in stored:
                record = SpanRecord.of(derived, await self._sizes(run, derived), size)
                known[(record.from_version, record.to_version)] = record
            self._records[run] = known
        return known
