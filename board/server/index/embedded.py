"""The in-process index: dictionaries and futures, for a single board process."""

from __future__ import annotations

import uuid

from deltaboard.board.contract.schemas import FleetNode, Head
from deltaboard.board.server.index import HeadWaiters
from deltaboard.board.server.records import RunRecord, VersionRecord, head_rank


class EmbeddedIndex:
    def __init__(self) -> None:
        self.waiters = HeadWaiters()
        self._generation = uuid.uuid4().hex
        self._runs: dict[str, RunRecord] = {}
        self._heads: dict[str, Head] = {}
        self._versions: dict[str, dict[int, VersionRecord]] = {}
        self._fleet: dict[str, dict[str, FleetNode]] = {}
        self._touches: dict[str, dict[str, float]] = {}

    async def start(self) -> None:
        return None

    async def generation(self) -> str:
        """Constant: an in-process index lives and dies with the board."""
        return self._generation

    async def close(self) -> None:
        return None

    async def load_run(
        self, run: RunRecord, versions: list[VersionRecord], head: Head, generation: str
    ) -> bool:
        if generation != self._generation:
            return False
        await self.put_versions(run.name, versions)
        await self.advance_head(head)
        self._runs[run.name] = run
        return True

    async def get_run(self, name: str) -> RunRecord | None:
        return self._runs.get(name)

    async def list_runs(self) -> list[RunRecord]:
        return sorted(self._runs.values(), key=lambda r: r.name)

    async def get_head(self, run: str) -> Head | None:
        return self._heads.get(run)

    def known_head(self, run: str) -> Head | None:
        return self._heads.get(run) if run in self._runs else None

    async def advance_head(self, head: Head) -> bool:
        if head_rank(head) <= head_rank(self._heads.get(head.run)):
            return False
        self._heads[head.run] = head
        self.waiters.notify(head)
        return True

    async def put_versions(self, run: str, records: list[VersionRecord]) -> None:
        versions = self._versions.setdefault(run, {})
        for record in records:
            versions[record.version] = record

    async def versions(self, run: str) -> dict[int, VersionRecord]:
        return dict(self._versions.get(run, {}))

    async def drop_versions(self, run: str, versions: list[int]) -> None:
        held = self._versions.get(run, {})
        for v in versions:
            held.pop(v, None)

    async def heartbeat(self, run: str, node: FleetNode) -> None:
        self._fleet.setdefault(run, {})[node.node_id] = node

    async def fleet(self, run: str, seen_after: float) -> list[FleetNode]:
        nodes = self._fleet.get(run, {})
        for node_id in [i for i, n in nodes.items() if n.last_seen <= seen_after]:
            del nodes[node_id]
        return sorted(nodes.values(), key=lambda n: n.node_id)

    async def touch_blob(self, run: str, sha256: str, at: float) -> None:
        self._touches.setdefault(run, {})[sha256] = at

    async def blob_touches(self, run: str) -> dict[str, float]:
        return dict(self._touches.get(run, {}))
