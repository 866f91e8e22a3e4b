"""The board's FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from deltaboard.board.contract.errors import BoardUnavailable
from deltaboard.board.server.api import blobs, ops, runs, spans, versions
from deltaboard.board.server.api.errors import install_error_handlers
from deltaboard.board.server.api.middleware import (
    GZIP_EXCLUDED,
    GZIP_LEVEL,
    GZIP_MIN_BYTES,
    BlobsUncompressed,
    BoardMiddleware,
)
from deltaboard.board.server.api.state import BoardState
from deltaboard.board.server.api.ui import dashboard
from deltaboard.board.server.clock import Clock, SystemClock
from deltaboard.board.server.service import BoardService
from deltaboard.board.server.settings import Settings
from deltaboard.board.server.storage.local import remove_stale_files

log = logging.getLogger("deltaboard.board")


async def maintain(service: BoardService, settings: Settings) -> None:
    """With a shared index: every `index_check_s`, rebuild it if it was lost
    (`BoardService.check_index`); every `reconcile_s` (0: never), bring its heads up to
    the store's (`BoardService.reconcile`)."""
    loop = asyncio.get_running_loop()
    reconciled = loop.time()
    while True:
        await asyncio.sleep(settings.index_check_s)
        try:
            rebuilt = await service.check_index()
            if settings.reconcile_s > 0 and loop.time() - reconciled >= settings.reconcile_s:
                if not rebuilt:
                    await service.reconcile()
                reconciled = loop.time()
        except BoardUnavailable as exc:  # Redis or the store out of reach: expected, said once
            log.warning("checking the index against the store failed (%s); retrying", exc)
        except Exception:
            log.warning("checking the index against the store failed; retrying", exc_info=True)


def create_app(settings: Settings | None = None, clock: Clock | None = None) -> FastAPI:
    """The board's app; `clock` (default: the system's) is the one clock of the board."""
    settings = settings or Settings()
    state = BoardState.build(settings, clock or SystemClock())
    service = state.service

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.tmp_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_files(settings.tmp_dir)  # uploads cut short by a crash
        await service.start()
        task = asyncio.create_task(maintain(service, settings)) if settings.shared_index else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await service.close()

    # /docs and /redoc from assets shipped in a package, not a CDN: a board often runs
    # where nothing outside can be reached, and /openapi.json is the reference anyway.
    app = FastAPIOffline(
        title="deltaboard board",
        version="1",
        description="Versioned bulletin board of lossless rollout-view deltas (docs/contract.md section 4).",
        lifespan=lifespan,
    )
    app.state.board = state
    modules = (runs, blobs, versions, spans, ops)
    install_error_handlers(app, [route for module in modules for route in module.router.routes])
    app.add_middleware(
        BlobsUncompressed,
        minimum_size=GZIP_MIN_BYTES,
        compresslevel=GZIP_LEVEL,
        exclude_content_types=GZIP_EXCLUDED,
    )
    app.add_middleware(
        BoardMiddleware,
        metrics=state.metrics,
        max_body_bytes=settings.max_body_bytes,
        body_idle_s=settings.body_idle_timeout_s,
    )
    for module in modules:
        app.include_router(module.router)
    app.mount("/ui", dashboard(), name="ui")
    return app
