"""Routes for versions: commit, head (with long-poll), the commit event stream,
manifests and plans."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response, StreamingResponse

from deltaboard.board.contract.schemas import MAX_VERSION, CommitRequest, Head, Plan
from deltaboard.board.server.api.state import BoardState, Publisher, Reader

router = APIRouter(prefix="/v1/runs/{run}")


@router.post("/commit", status_code=201, response_model=Head)
async def commit(run: str, body: CommitRequest, state: BoardState = Publisher) -> Head:
    return await state.service.commit(run, body.manifest)


@functools.lru_cache(maxsize=256)
def _head_json(head: Head) -> bytes:
    return head.model_dump_json().encode()


def encoded(head: Head) -> Response:
    """One serialisation per head, shared by every poller it wakes (a thousand pollers
    would otherwise each validate and encode the same model)."""
    return Response(_head_json(head), media_type="application/json")


@router.get("/head", response_model=Head)
async def head(
    run: str,
    after: int | None = Query(default=None, ge=-1, le=MAX_VERSION),
    wait: float = Query(default=0.0, ge=0, le=60),
    state: BoardState = Reader,
) -> Response:
    """Answer at once if head > `after`; otherwise wait up to `wait` seconds for a commit."""
    return encoded(await state.service.wait_for_head(run, after, wait))


@router.get("/events", response_class=StreamingResponse)
async def events(run: str, state: BoardState = Reader) -> StreamingResponse:
    """Server-sent events: `event: commit` with the head, first the current one. Commits that
    land faster than a client reads coalesce into the latest head."""
    heads = await state.service.heads(run)

    async def stream() -> AsyncIterator[str]:
        async with contextlib.aclosing(heads):
            async for current in heads:
                if current is None:
                    yield ": keepalive\n\n"
                else:
                    yield f"event: commit\ndata: {current.model_dump_json()}\n\n"

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/manifests/{version}", response_model=None)
async def manifest(
    run: str, version: int = Path(ge=0, le=MAX_VERSION), state: BoardState = Reader
) -> Response:
    data = await state.service.manifest(run, version)
    return Response(
        data, media_type="application/json", headers={"Cache-Control": "public, max-age=31536000, immutable"}
    )


@router.get("/plan", response_model=Plan)
async def plan(
    run: str,
    from_version: int | None = Query(default=None, alias="from", ge=0, le=MAX_VERSION),
    to_version: int | None = Query(default=None, alias="to", ge=0, le=MAX_VERSION),
    state: BoardState = Reader,
) -> Plan:
    return await state.service.plan(run, from_version, to_version)
