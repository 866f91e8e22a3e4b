"""Index port: the fast cache and notification bus in front of the object store.

It holds what the hot paths read (runs, heads, per-version blob sizes, fleet heartbeats)
and wakes long-polls when a head advances. It is never the truth: the board rebuilds it
from the store on start and whenever its generation marker changes
(`BoardService.rebuild`, `check_index`), and a route that misses a run reads it from the
store, so losing the index loses nothing.
Adapters: `deltaboard.board.server.index.embedded.EmbeddedIndex` (one process) and
`deltaboard.board.server.index.redis.RedisIndex` (several replicas; heads travel over pub/sub).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from deltaboard.board.contract.schemas import FleetNode, Head
from deltaboard.board.server.records import RunRecord, VersionRecord


class HeadWaiters:
    """Per-run futures that resolve with the next head announced in this process.

    A waiter takes the future *before* reading the head, so a commit landing in between
    still wakes it; one future per run serves every waiter, so a commit costs O(1) to
    announce whatever the number of pollers.
    """

    def __init__(self) -> None:
        self._futures: dict[str, asyncio.Future[Head]] = {}

    def future(self, run: str) -> asyncio.Future[Head]:
        fut = self._futures.get(run)
        if fut is None or fut.done():
            fut = asyncio.get_running_loop().create_future()
            self._futures[run] = fut
        return fut

    def runs(self) -> list[str]:
        """The runs that have waiters now."""
        return [run for run, fut in self._futures.items() if not fut.done()]

    def notify(self, head: Head) -> None:
        fut = self._futures.pop(head.run, None)
        if fut is not None and not fut.done():
            fut.set_result(head)


class Index(Protocol):
    waiters: HeadWaiters

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def generation(self) -> str:
        """This index's generation marker, created if missing. The board loads the index
        under one generation; a different answer later means the index was lost (a Redis
        flushed, or restarted without persistence) and must be rebuilt from the store."""
        ...

    async def load_run(
        self, run: RunRecord, versions: list[VersionRecord], head: Head, generation: str
    ) -> bool:
        """Put the run with its versions and its head, all or nothing (the head only where
        it ranks above the cached one, as `advance_head`). A run in the index therefore
        always has the versions its head needs: a Redis restarted between separate writes
        would otherwise hold the run and its head without them, and answer `NoChain` for
        committed versions until the next rebuild.

        Nothing is written, and False returned, unless the index is still of `generation`
        (read before the store was): an index lost meanwhile may have served a head that
        a commit put there since, and a head read from the store before that commit,
        written into the emptied index, would take the head back (chaos seed 1030077618:
        843, then 836)."""
        ...

    async def get_run(self, name: str) -> RunRecord | None: ...

    async def list_runs(self) -> list[RunRecord]: ...

    async def get_head(self, run: str) -> Head | None: ...

    def known_head(self, run: str) -> Head | None:
        """The run's head where this process holds the index (read without I/O or a task:
        the long-polls answered in the HTTP protocol, `api.longpoll`); None where the index
        lives elsewhere, or misses the run (the routes then ask `get_head`)."""
        ...

    async def advance_head(self, head: Head) -> bool:
        """Record `head` if it ranks above the cached one (`records.head_rank`) and wake the
        long-polls of every replica. Returns whether it advanced."""
        ...

    async def put_versions(self, run: str, records: list[VersionRecord]) -> None: ...

    async def versions(self, run: str) -> dict[int, VersionRecord]: ...

    async def drop_versions(self, run: str, versions: list[int]) -> None: ...

    async def heartbeat(self, run: str, node: FleetNode) -> None: ...

    async def fleet(self, run: str, seen_after: float) -> list[FleetNode]:
        """The nodes heard from after `seen_after` (sorted by id); older ones are dropped
        from the index, so that nodes that went away do not accumulate."""
        ...

    async def touch_blob(self, run: str, sha256: str, at: float) -> None:
        """Note that a deduplicated upload claimed a stored blob (retention's grace clock)."""
        ...

    async def blob_touches(self, run: str) -> dict[str, float]: ...
