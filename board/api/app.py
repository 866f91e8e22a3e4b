"""The board's FastAPI application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from board.api import blobs, ops, runs, versions
from board.api.errors import install_error_handlers
from board.api.middleware import BoardMiddleware
from board.api.state import BoardState
from board.settings import Settings


async def rebuild_index(state: BoardState) -> None:
    """Load runs, heads and version records from the store: the index is only a cache."""
    for record in await state.blocking(state.ledger.runs):
        await state.index.put_run(record)
        head, _ = await state.blocking(state.ledger.head, record.name)
        records = await state.blocking(state.ledger.committed_versions, record.name, head.version)
        await state.index.put_versions(record.name, records)
        await state.index.advance_head(head.wire(record.name))


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    state = BoardState.build(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.tmp_dir.mkdir(parents=True, exist_ok=True)
        await state.index.start()
        await rebuild_index(state)
        try:
            yield
        finally:
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
