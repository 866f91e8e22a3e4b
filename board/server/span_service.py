"""The board's span use cases: register a span after checking it against the committed
manifests of its ends, read one back, and know a run's spans for planning.

Spans are derived data (docs/contract.md §3): the store holds them beside the manifests
(`runs/{run}/spans/{from}-{to}.json`, create-if-absent), and this board keeps what it read
or registered in memory for plans, loading a run's spans from the store on first use. A
span registered through another board is seen after a restart; until then plans simply
do without it (a span only ever saves bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltaboard.board.contract.errors import BadManifest, UnknownVersion
from deltaboard.board.contract.schemas import Manifest
from deltaboard.board.contract.spans import SpanManifest, SpanRegistered
from deltaboard.board.server.rules import check_blob_ranges
from deltaboard.board.server.spans import SpanRecord, check_span, span_url

if TYPE_CHECKING:
    from deltaboard.board.server.service import BoardService


class SpanBook:
    """Spans of every run this board serves (see the module docstring)."""

    def __init__(self, service: BoardService) -> None:
        self.service = service
        self._records: dict[str, dict[tuple[int, int], SpanRecord]] = {}

    async def _chain(self, run: str, span: SpanManifest) -> list[Manifest]:
        """The committed manifests from the last keyframe at or below the span's first
        version up to its last."""
        current = await self.service.head(run)
        if current.version is None or span.to_version > current.version:
            raise UnknownVersion(f"version {span.to_version} is not committed (head {current.version})")
        versions = await self.service.index.versions(run)
        keyframes = [v for v, r in versions.items() if r.kind == "full" and v <= span.from_version]
        if not keyframes:
            raise BadManifest(f"no keyframe at or below version {span.from_version} is kept")
        return [
            Manifest.model_validate_json(await self.service.manifest(run, v))
            for v in range(max(keyframes), span.to_version + 1)
        ]

    async def _sizes(self, run: str, span: SpanManifest) -> dict[str, int | None]:
        ledger = self.service.ledger
        return {sha: await self.service.blocking(ledger.blob_size, run, sha) for sha in span.blob_shas()}

    async def register(self, run: str, span: SpanManifest) -> SpanRegistered:
        """Check `span` (`BadManifest`, `MissingBlobs`) and store it unless a span with the
        same ends is stored already (that one stands: it passed the same checks)."""
        await self.service.require_run(run)
        check_span(span, run, await self._chain(run, span))
        ledger = self.service.ledger
        sizes = {sha: await self.service.blocking(ledger.blob_size, run, sha) for sha in span.blob_shas()}
        check_blob_ranges(span, sizes)
        data, created = await self.service.blocking(ledger.put_span, run, span)
        stored = span if created else SpanManifest.model_validate_json(data)
        (await self.records(run))[(span.from_version, span.to_version)] = SpanRecord.of(
            stored, sizes, len(data)
        )
        return SpanRegistered(
            run=run,
            from_version=span.from_version,
            to_version=span.to_version,
            manifest_url=span_url(run, span.from_version, span.to_version),
            created=created,
            bytes=len(data),
        )

    async def manifest(self, run: str, from_version: int, to_version: int) -> bytes:
        await self.service.require_run(run)
        data = await self.service.blocking(self.service.ledger.span_bytes, run, from_version, to_version)
        if data is None:
            raise UnknownVersion(f"no span {from_version} -> {to_version} is stored")
        return data

    async def records(self, run: str, *, reload: bool = False) -> dict[tuple[int, int], SpanRecord]:
        """The run's spans by their ends, loaded from the store on first use or when asked
        (retention does: a span another replica stored must keep its blobs)."""
        known = self._records.get(run)
        if known is None or reload:
            ledger = self.service.ledger
            known = {}
            for span, size in await self.service.blocking(ledger.spans, run):
                sizes = {
                    sha: await self.service.blocking(ledger.blob_size, run, sha) for sha in span.blob_shas()
                }
                known[(span.from_version, span.to_version)] = SpanRecord.of(span, sizes, size)
            self._records[run] = known
        return known
