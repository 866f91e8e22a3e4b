"""What every route needs: the service (over the store, the index and the ledger), auth
and metrics, built from the settings once per app, plus the dependencies that authorise
a request and the path parameters' types.

Names in the path are checked here (400 `BadRunName`, `BadDigest`, `BadAssetName`), not by
FastAPI (which would answer 422); their patterns are declared in the OpenAPI schema only.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from deltaboard.board.contract.errors import ErrorCode, InvalidRequest
from deltaboard.board.contract.schemas import ASSET_NAME_RE, RUN_NAME_RE, SHA256_RE
from deltaboard.board.server.auth import AuthConfig, Authorizer, Scope
from deltaboard.board.server.clock import Clock
from deltaboard.board.server.index import Index
from deltaboard.board.server.metrics import BoardMetrics
from deltaboard.board.server.service import BoardService
from deltaboard.board.server.settings import Settings
from deltaboard.board.server.storage import ObjectStore


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
    auth: Authorizer
    metrics: BoardMetrics
    service: BoardService

    @classmethod
    def build(cls, settings: Settings, clock: Clock) -> BoardState:
        metrics = BoardMetrics()
        service = BoardService(settings, open_store(settings), open_index(settings), metrics, clock)
        return cls(settings=settings, auth=load_auth(settings), metrics=metrics, service=service)


def _named(description: str, pattern: re.Pattern[str]) -> Any:
    return Path(description=description, json_schema_extra={"pattern": pattern.pattern})


RunPath = Annotated[str, _named("run name", RUN_NAME_RE)]
ShaPath = Annotated[str, _named("sha256 of the blob, lowercase hex", SHA256_RE)]
AssetPath = Annotated[str, _named("asset name: 1-2 path segments", ASSET_NAME_RE)]


def check_sha(sha256: str) -> None:
    if not SHA256_RE.fullmatch(sha256):
        raise InvalidRequest("blob keys are lowercase hex sha256 digests", code=ErrorCode.BAD_DIGEST)


def check_asset_name(name: str) -> None:
    if not ASSET_NAME_RE.fullmatch(name):
        raise InvalidRequest(
            "asset names are 1-2 path segments of [A-Za-z0-9._-], no '..'", code=ErrorCode.BAD_ASSET_NAME
        )


def board_state(request: Request) -> BoardState:
    state: BoardState = request.app.state.board
    return state


# Declares the bearer scheme in the OpenAPI schema; `Authorizer` checks the header itself.
BEARER = HTTPBearer(auto_error=False, description="a token of scope read, compact, publish or admin")


def authorized(scope: Scope) -> Callable[..., Awaitable[BoardState]]:
    """A dependency: validates the `{run}` path parameter, then the bearer token's scope on it."""

    async def dependency(
        request: Request, _: HTTPAuthorizationCredentials | None = Security(BEARER)
    ) -> BoardState:
        state = board_state(request)
        run = request.path_params.get("run")
        if run is not None and not RUN_NAME_RE.fullmatch(run):
            raise InvalidRequest(
                "run names are 1-128 of [A-Za-z0-9._-], not starting with . or -", code=ErrorCode.BAD_RUN_NAME
            )
        state.auth.check(request.headers.get("authorization"), scope, run)
        return state

    return dependency


Reader = Depends(authorized("read"))
Compactor = Depends(authorized("compact"))
Publisher = Depends(authorized("publish"))
Admin = Depends(authorized("admin"))
