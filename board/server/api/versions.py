"""Routes for versions: commit, head (with long-poll), the commit event stream,
manifests and plans."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response, StreamingResponse

from deltaboard.board.contract.errors import not_found
from deltaboard.board.contract.schemas import MAX_VERSION, CommitRequest, Head, Plan
from deltaboard.board.server import plan as planning
from deltaboard.board.server.api.state import BoardState, Publisher, Reader

router = APIRouter(prefix="/v1/runs/{run}")

KEEPALIVE_S = 15.0


@router.post("/commit", status_code=201, response_model=Head)
async def commit(run: str, body: CommitRequest, state: BoardState = Publisher) -> Head:
    await state.require_run(run)
    started = time.perf_counter()
    head_record, version_record = await state.blocking(state.ledger.commit, run, body.manifest)
    # The version record goes first: a poller woken by the head must find its plan.
    await state.index.put_versions(run, [version_record])
    head = head_record.wire(run)
    await state.index.advance_head(head)
    state.metrics.commits.inc()
    state.metrics.commit_seconds.observe(time.perf_counter() - started)
    return head


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
    await state.require_run(run)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait, state.settings.max_wait_s)
    state.metrics.waiting.inc()
    try:
        while True:
            # Take the future before reading the head: a commit in between still wakes us.
            future = state.index.waiters.future(run)
            current = await state.head(run)
            if after is None or (current.version is not None and current.version > after):
                return encoded(current)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return encoded(current)
            done, _ = await asyncio.wait({future}, timeout=remaining)
            if done:
                woken = future.result()
                if woken.version is not None and woken.version > after:
                    return encoded(woken)
    finally:
        state.metrics.waiting.dec()


@router.get("/events", response_class=StreamingResponse)
async def events(run: str, state: BoardState = Reader) -> StreamingResponse:
    """Server-sent events: `event: commit` with the head, first the current one. Commits that
    land faster than a client reads coalesce into the latest head."""
    await state.require_run(run)

    async def stream() -> AsyncIterator[str]:
        last: int | None = None
        sent = False
        state.metrics.waiting.inc()
        try:
            while True:
                future = state.index.waiters.future(run)
                current = await state.head(run)
                if not sent or current.version != last:
                    yield f"event: commit\ndata: {current.model_dump_json()}\n\n"
                    last, sent = current.version, True
                done, _ = await asyncio.wait({future}, timeout=KEEPALIVE_S)
                if not done:
                    yield ": keepalive\n\n"
        finally:
            state.metrics.waiting.dec()

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/manifests/{version}", response_model=None)
async def manifest(
    run: str, version: int = Path(ge=0, le=MAX_VERSION), state: BoardState = Reader
) -> Response:
    await state.require_run(run)
    current = await state.head(run)
    if current.version is None or version > current.version:
        raise not_found("UnknownVersion", f"version {version} is not committed (head {current.version})")
    data = state.manifests.get((run, version))
    if data is None:
        data = await state.blocking(state.ledger.manifest_bytes, run, version)
        if data is None:
            raise not_found("UnknownVersion", f"version {version} was pruned")
        state.cache_manifest(run, version, data)
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
    await state.require_run(run)
    current = await state.head(run)
    versions = await state.index.versions(run)
    return planning.plan(run, versions, current.version, from_version, to_version)
