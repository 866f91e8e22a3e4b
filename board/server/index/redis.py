"""The Redis (or Valkey) index: shared by several board replicas.

Heads advance through a Lua script (compare by version, then epoch: atomic, monotonic) that
also PUBLISHes the new head; every replica keeps one subscription and wakes its own
long-polls from it, so a commit on one replica wakes pollers on all of them.

Redis unreachable (down, restarting, frozen past `COMMAND_TIMEOUT_S`) is `IndexUnavailable`
(503), never a 500; the board rebuilds what a restart without persistence lost
(`generation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT, FieldT

from deltaboard.board.contract.errors import IndexUnavailable
from deltaboard.board.contract.schemas import FleetNode, Head
from deltaboard.board.server.index import HeadWaiters
from deltaboard.board.server.records import RunRecord, VersionRecord, head_rank

log = logging.getLogger("deltaboard.board.redis")

# Moves a run's head only forward (by version, then epoch) and announces it. A Lua function
# shared by the two scripts below; version and epoch are passed as strings and stored so.
_ADVANCE = """
local function advance(head_key, channel, json, new_version, new_epoch)
  local version = tonumber(redis.call('HGET', head_key, 'version') or '-2')
  local epoch = tonumber(redis.call('HGET', head_key, 'epoch') or '-2')
  local v, e = tonumber(new_version), tonumber(new_epoch)
  if v > version or (v == version and e > epoch) then
    redis.call('HSET', head_key, 'json', json, 'version', new_version, 'epoch', new_epoch)
    redis.call('PUBLISH', channel, json)
    return 1
  end
  return 0
end
"""
ADVANCE_HEAD = _ADVANCE + "return advance(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])"
# A run loaded from the store (`load_run`): nothing unless the index is still the generation
# the caller loaded under (-1), else its versions (field, value pairs from ARGV[7], in
# slices that Lua's unpack takes), its head where it ranks above the index's, its record.
LOAD_RUN = (
    _ADVANCE
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
for i = 7, #ARGV, 1000 do
  redis.call('HSET', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
local advanced = advance(KEYS[3], KEYS[5], ARGV[2], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[4], ARGV[5], ARGV[6])
return advanced
"""
)

RESUBSCRIBE_S = 0.5
COMMAND_TIMEOUT_S = 5.0

P = ParamSpec("P")
R = TypeVar("R")


def reachable(method: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn a lost or timed-out connection into `IndexUnavailable` (the request is answered
    503 and retried; redis-py reconnects on the next command)."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise IndexUnavailable(f"the board's index (Redis) is unreachable: {exc}") from exc

    return wrapper


def _version_fields(records: list[VersionRecord]) -> dict[FieldT, EncodableT]:
    return {str(r.version): r.model_dump_json() for r in records}


class RedisIndex:
    def __init__(self, url: str, namespace: str = "deltaboard") -> None:
        self.waiters = HeadWaiters()
        self.url = url
        self.ns = namespace
        self.channel = f"{namespace}:heads"
        self._redis: Redis | None = None
        self._bus: Redis | None = None  # the subscription's: it waits without a timeout
        self._listener: asyncio.Task[None] | None = None
        self._subscribed: asyncio.Event | None = None

    @property
    def redis(self) -> Redis:
        assert self._redis is not None, "RedisIndex.start() was not awaited"
        return self._redis

    def _k(self, kind: str, run: str | None = None) -> str:
        return f"{self.ns}:{kind}" if run is None else f"{self.ns}:{kind}:{run}"

    async def start(self) -> None:
        self._redis = Redis.from_url(
            self.url, socket_timeout=COMMAND_TIMEOUT_S, socket_connect_timeout=COMMAND_TIMEOUT_S
        )
        self._bus = Redis.from_url(self.url)
        self._subscribed = asyncio.Event()
        self._listener = asyncio.create_task(self._listen())
        await asyncio.wait_for(self._subscribed.wait(), timeout=30)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        for client in (self._redis, self._bus):
            if client is not None:
                await client.aclose()

    async def _listen(self) -> None:
        """Forward heads published by any replica to this process's waiters, for ever."""
        assert self._subscribed is not None and self._bus is not None
        while True:
            try:
                async with self._bus.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    if self._subscribed.is_set():
                        await self._wake_missed()
                    self._subscribed.set()
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self.waiters.notify(Head.model_validate_json(message["data"]))
            except (RedisError, IndexUnavailable) as exc:
                log.warning("head subscription lost (%s); resubscribing", exc)
                await asyncio.sleep(RESUBSCRIBE_S)

    async def _wake_missed(self) -> None:
        """After a lost subscription: heads published meanwhile never reached us, so hand
        the current ones to the runs that have waiters (a waiter re-checks what it gets)."""
        for run in self.waiters.runs():
            head = await self.get_head(run)
            if head is not None:
                self.waiters.notify(head)

    @reachable
    async def generation(self) -> str:
        """One round trip: set a fresh marker unless one exists, and read the one there."""
        fresh = uuid.uuid4().hex
        found = await self.redis.set(self._k("generation"), fresh, nx=True, get=True)
        if found is None:
            return fresh
        assert isinstance(found, bytes)
        return found.decode()

    @reachable
    async def load_run(
        self, run: RunRecord, versions: list[VersionRecord], head: Head, generation: str
    ) -> bool:
        """One script: a restart lands before it or after it, never inside it, and a flush
        since `generation` was read leaves it writing nothing."""
        version, epoch = head_rank(head)
        pairs = [item for field in _version_fields(versions).items() for item in field]
        keys = (
            self._k("generation"),
            self._k("versions", run.name),
            self._k("head", run.name),
            self._k("runs"),
            self.channel,
        )
        args = (generation, head.model_dump_json(), version, epoch, run.name, run.model_dump_json(), *pairs)
        answer = await self.redis.eval(LOAD_RUN, len(keys), *keys, *args)
        if answer == 1:  # the head advanced: our own pollers need not wait for the round trip
            self.waiters.notify(head)
        return bool(answer >= 0)

    @reachable
    async def get_run(self, name: str) -> RunRecord | None:
        data = await self.redis.hget(self._k("runs"), name)
        return None if data is None else RunRecord.model_validate_json(data)

    @reachable
    async def list_runs(self) -> list[RunRecord]:
        found: dict[Any, Any] = await self.redis.hgetall(self._k("runs"))
        return sorted((RunRecord.model_validate_json(v) for v in found.values()), key=lambda r: r.name)

    @reachable
    async def get_head(self, run: str) -> Head | None:
        data = await self.redis.hget(self._k("head", run), "json")
        return None if data is None else Head.model_validate_json(data)

    def known_head(self, run: str) -> Head | None:
        """None: the head lives in Redis, where another replica may have moved it."""
        return None

    @reachable
    async def advance_head(self, head: Head) -> bool:
        version, epoch = head_rank(head)
        advanced = await self.redis.eval(
            ADVANCE_HEAD, 2, self._k("head", head.run), self.channel, head.model_dump_json(), version, epoch
        )
        if advanced:
            self.waiters.notify(head)  # our own pollers need not wait for the round trip
        return bool(advanced)

    @reachable
    async def put_versions(self, run: str, records: list[VersionRecord]) -> None:
        if records:
            await self.redis.hset(self._k("versions", run), mapping=_version_fields(records))

    @reachable
    async def versions(self, run: str) -> dict[int, VersionRecord]:
        found: dict[Any, Any] = await self.redis.hgetall(self._k("versions", run))
        return {int(k): VersionRecord.model_validate_json(v) for k, v in found.items()}

    @reachable
    async def drop_versions(self, run: str, versions: list[int]) -> None:
        if versions:
            await self.redis.hdel(self._k("versions", run), *[str(v) for v in versions])

    @reachable
    async def heartbeat(self, run: str, node: FleetNode) -> None:
        await self.redis.hset(self._k("fleet", run), node.node_id, node.model_dump_json())

    @reachable
    async def fleet(self, run: str, seen_after: float) -> list[FleetNode]:
        """A node that beats between the read and the deletion of its stale entry drops out
        until its next heartbeat: harmless for a listing, and no script is needed."""
        found: dict[Any, Any] = await self.redis.hgetall(self._k("fleet", run))
        nodes = [FleetNode.model_validate_json(v) for v in found.values()]
        stale = [n.node_id for n in nodes if n.last_seen <= seen_after]
        if stale:
            await self.redis.hdel(self._k("fleet", run), *stale)
        return sorted((n for n in nodes if n.last_seen > seen_after), key=lambda n: n.node_id)

    @reachable
    async def touch_blob(self, run: str, sha256: str, at: float) -> None:
        await self.redis.hset(self._k("touch", run), sha256, str(at))

    @reachable
    async def blob_touches(self, run: str) -> dict[str, float]:
        found: dict[Any, Any] = await self.redis.hgetall(self._k("touch", run))
        return {k.decode(): float(v) for k, v in found.items()}
