"""Routes for versions: commit, head (with long-poll), the commit event stream,
manifests and plans."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response, StreamingResponse

from deltaboard.board.contract.schemas import (
    MAX_VERSION,
    CommitRequest,
    Head,
    Manifest,
    Plan,
    Prepared,
    PrepareRequest,
    VersionSummary,
)
from deltaboard.board.server.api.errors import documented
from deltaboard.board.server.api.routing import INPUT_ERRORS, RUN_ERRORS, BoardRoute
from deltaboard.board.server.api.state import BoardState, Publisher, Reader, RunPath

router = APIRouter(prefix="/v1/runs/{run}", route_class=BoardRoute)

READ_ERRORS = documented(*RUN_ERRORS)


@router.post(
    "/commit", status_code=201, response_model=Head, responses=documented(*RUN_ERRORS, 409, *INPUT_ERRORS)
)
async def commit(run: RunPath, body: CommitRequest, state: BoardState = Publisher) -> Head:
    return await state.service.commit(run, body.committed)


@router.post(
    "/prepare", status_code=201, response_model=Prepared, responses=documented(*RUN_ERRORS, *INPUT_ERRORS)
)
async def prepare(run: RunPath, body: PrepareRequest, state: BoardState = Publisher) -> Prepared:
    """Check a manifest and hold it for a commit that names it (`CommitRequest.prepared`)."""
    return await state.service.prepare(run, body.manifest)


MAX_WAIT_S = 60  # a long-poll's longest wait (the board's own cap is `Settings.max_wait_s`)


@functools.lru_cache(maxsize=256)
def head_json(head: Head) -> bytes:
    return head.model_dump_json().encode()


def encoded(head: Head) -> Response:
    """One serialisation per head, shared by every poller it wakes (a thousand pollers
    would otherwise each validate and encode the same model)."""
    return Response(head_json(head), media_type="application/json")


@router.get("/head", response_model=Head, responses=READ_ERRORS)
async def head(
    run: RunPath,
    after: int | None = Query(default=None, ge=-1, le=MAX_VERSION),
    wait: float = Query(default=0.0, ge=0, le=MAX_WAIT_S),
    state: BoardState = Reader,
) -> Response:
    """Answer at once if head > `after`; otherwise wait up to `wait` seconds for a commit."""
    return encoded(await state.service.wait_for_head(run, after, wait))


@router.get(
    "/events",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}, "description": "heads"},
        **documented(*RUN_ERRORS),
    },
)
async def events(run: RunPath, state: BoardState = Reader) -> StreamingResponse:
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


MAX_SUMMARIES = 10_000


@router.get("/versions", response_model=list[VersionSummary], responses=READ_ERRORS)
async def versions(
    run: RunPath,
    limit: int = Query(default=1000, ge=1, le=MAX_SUMMARIES),
    state: BoardState = Reader,
) -> list[VersionSummary]:
    """The last `limit` committed versions, oldest first, one line each (what the
    operators' dashboard charts, without reading a manifest per version)."""
    return await state.service.versions(run, limit)


@router.get(
    "/manifests/{version}",
    response_class=Response,
    responses={200: {"model": Manifest, "description": "the manifest, as stored"}, **READ_ERRORS},
)
async def manifest(
    request: Request, run: RunPath, version: int = Path(ge=0, le=MAX_VERSION), state: BoardState = Reader
) -> Response:
    """The manifest's JSON; to a client that accepts zstd, as the board stores it (one zstd
    frame), else gzipped or not by the app's gzip layer."""
    packed = accepts_zstd(request.headers.get("accept-encoding", ""))
    data = await state.service.manifest(run, version, packed=packed)
    headers = {"Cache-Control": "public, max-age=31536000, immutable", "Vary": "Accept-Encoding"}
    if packed:
        headers["Content-Encoding"] = "zstd"
    return Response(data, media_type="application/json", headers=headers)


def accepts_zstd(accept_encoding: str) -> bool:
    """Whether an `Accept-Encoding` header lists zstd with a weight above 0 (RFC 9110)."""
    for item in accept_encoding.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() != "zstd":
            continue
        name, _, weight = params.strip().partition("=")
        if name.strip().lower() != "q":
            return True
        try:
            return float(weight) > 0
        except ValueError:
            return False
    return False


@router.get("/plan", response_model=Plan, responses=READ_ERRORS)
async def plan(
    run: RunPath,
    from_version: int | None = Query(default=None, alias="from", ge=0, le=MAX_VERSION),
    to_version: int | None = Query(default=None, alias="to", ge=0, le=MAX_VERSION),
    state: BoardState = Reader,
) -> Plan:
    return await state.service.plan(run, from_version, to_version)
