"""The board's FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from deltaboard.board.contract.schemas import Head
from deltaboard.board.server.api import blobs, ops, runs, versions
from deltaboard.board.server.api.errors import install_error_handlers
from deltaboard.board.server.api.middleware import BoardMiddleware
from deltaboard.board.server.api.state import BoardState
from deltaboard.board.server.records import head_rank
from deltaboard.board.server.settings import Settings
from deltaboard.board.server.storage.local import remove_stale_files

log = logging.getLogger("deltaboard.board")


async def catch_up(state: BoardState, run: str, known: Head | None) -> None:
    """Bring the index's view of `run` up to the store's head (versions first, then the head,
    so that a woken poller finds its plan)."""
    head, _ = await state.blocking(state.ledger.head, run)
    if head_rank(head) <= head_rank(known):
        return
    after = None if known is None else known.version
    records = await state.blocking(state.ledger.committed_versions, run, head.version, after)
    await state.index.put_versions(run, records)
    await state.index.advance_head(head.wire(run))


async def rebuild_index(state: BoardState) -> None:
    """Load runs, heads and version records from the store: the index is only a cache."""
    for record in await state.blocking(state.ledger.runs):
        await state.index.put_run(record)
        await catch_up(state, record.name, None)


async def reconcile(state: BoardState, every_s: float) -> None:
    """With a shared index, a replica that dies between its head CAS and its index update
    would leave the others behind: every `every_s`, compare each run's head with the store."""
    while True:
        await asyncio.sleep(every_s)
        try:
            for record in await state.index.list_runs():
                await catch_up(state, record.name, await state.index.get_head(record.name))
        except Exception:
            log.warning("reconciling the index with the store failed; retrying", exc_info=True)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    state = BoardState.build(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.tmp_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_files(settings.tmp_dir)  # uploads cut short by a crash
        await state.index.start()
        await rebuild_index(state)
        task = asyncio.create_task(reconcile(state, settings.reconcile_s)) if settings.reconciles else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await state.index.close()

    app = FastAPI(
        title="deltaboard board",
        version="1",
        description="Versioned bulletin board of lossless rollout-view deltas (docs/contract.md section 4).",
        lifespan=lifespan,
    )
    app.state.board = state
    install_error_handlers(app)
    app.add_middleware(
        BoardMiddleware,
        metrics=state.metrics,
        max_body_bytes=settings.max_body_bytes,
        body_idle_s=settings.body_idle_timeout_s,
    )
    for module in (runs, blobs, versions, ops):
        app.include_router(module.router)
    return app
