"""What every route needs: the store, the index, the ledger, auth and metrics, built from
the settings once per app, plus the dependencies that authorise a request."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from deltaboard.board.contract.errors import bad_request, not_found
from deltaboard.board.contract.schemas import RUN_NAME_RE, SHA256_RE, Head
from deltaboard.board.server.auth import AuthConfig, Authorizer, Scope
from deltaboard.board.server.index import Index
from deltaboard.board.server.ledger import Ledger
from deltaboard.board.server.metrics import BoardMetrics
from deltaboard.board.server.records import RunRecord
from deltaboard.board.server.settings import Settings
from deltaboard.board.server.storage import ObjectStore

T = TypeVar("T")

MANIFEST_CACHE_SIZE = 512


def open_store(settings: Settings) -> ObjectStore:
    if settings.store and settings.store.startswith("s3://"):
        from deltaboard.board.server.storage.s3 import S3Store

        return S3Store.from_settings(settings)
    if settings.store:
        raise ValueError(f"unsupported store {settings.store!r} (use s3://bucket/prefix or leave unset)")
    from deltaboard.board.server.storage.local import LocalStore

    return LocalStore(settings.local_store_dir, fsync=settings.fsync)


def open_index(settings: Settings) -> Index:
    if settings.redis:
        from deltaboard.board.server.index.redis import RedisIndex

        return RedisIndex(settings.redis, namespace=settings.redis_namespace)
    from deltaboard.board.server.index.embedded import EmbeddedIndex

    return EmbeddedIndex()


def load_auth(settings: Settings) -> Authorizer:
    config = AuthConfig.load(settings.auth_config) if settings.auth_config else AuthConfig()
    grants = AuthConfig.parse_grants(s for s in settings.tokens.split(",") if s.strip())
    return Authorizer(config.merged(grants, settings.anonymous_read))


@dataclass
class BoardState:
    settings: Settings
    store: ObjectStore
    index: Index
    auth: Authorizer
    ledger: Ledger
    metrics: BoardMetrics = field(default_factory=BoardMetrics)
    manifests: OrderedDict[tuple[str, int], bytes] = field(default_factory=OrderedDict)

    @classmethod
    def build(cls, settings: Settings) -> BoardState:
        store = open_store(settings)
        return cls(
            settings=settings,
            store=store,
            index=open_index(settings),
            auth=load_auth(settings),
            ledger=Ledger(store),
        )

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run store I/O in a worker thread: the event loop keeps serving long-polls."""
        return await run_in_threadpool(fn, *args)

    async def require_run(self, run: str) -> RunRecord:
        record = await self.index.get_run(run)
        if record is None:
            raise not_found("UnknownRun", f"run {run!r} does not exist")
        return record

    async def head(self, run: str) -> Head:
        head = await self.index.get_head(run)
        return head if head is not None else Head(run=run, version=None)

    def cache_manifest(self, run: str, version: int, data: bytes) -> None:
        self.manifests[(run, version)] = data
        while len(self.manifests) > MANIFEST_CACHE_SIZE:
            self.manifests.popitem(last=False)


def check_sha(sha256: str) -> None:
    if not SHA256_RE.match(sha256):
        raise bad_request("BadDigest", "blob keys are lowercase hex sha256 digests")


def board_state(request: Request) -> BoardState:
    state: BoardState = request.app.state.board
    return state


def authorized(scope: Scope) -> Callable[[Request], Awaitable[BoardState]]:
    """A dependency: validates the `{run}` path parameter, then the bearer token's scope on it."""

    async def dependency(request: Request) -> BoardState:
        state = board_state(request)
        run = request.path_params.get("run")
        if run is not None and not RUN_NAME_RE.match(run):
            raise bad_request("BadRunName", "run names are 1-128 of [A-Za-z0-9._-], not starting with . or -")
        state.auth.check(request.headers.get("authorization"), scope, run)
        return state

    return dependency


Reader = Depends(authorized("read"))
Publisher = Depends(authorized("publish"))
Admin = Depends(authorized("admin"))
