"""Routes for operations: fleet heartbeats, retention, metrics and health."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from deltaboard.board.contract.schemas import FleetNode, Heartbeat, RetentionPolicy, RetentionReport
from deltaboard.board.server.api.state import Admin, BoardState, Reader, board_state
from deltaboard.board.server.retention import select_versions

router = APIRouter()


@router.post("/v1/runs/{run}/fleet", status_code=204)
async def heartbeat(run: str, body: Heartbeat, state: BoardState = Reader) -> Response:
    await state.require_run(run)
    node = FleetNode(
        node_id=body.node_id, version=body.version, engine=body.engine, meta=body.meta, last_seen=time.time()
    )
    await state.index.heartbeat(run, node)
    state.metrics.heartbeats.inc()
    return Response(status_code=204)


@router.get("/v1/runs/{run}/fleet", response_model=list[FleetNode])
async def fleet(run: str, state: BoardState = Reader) -> list[FleetNode]:
    await state.require_run(run)
    return await state.index.fleet(run, time.time() - state.settings.fleet_ttl_s)


@router.post("/v1/runs/{run}/retention", response_model=RetentionReport)
async def retention(run: str, body: RetentionPolicy, state: BoardState = Admin) -> RetentionReport:
    await state.require_run(run)
    current = await state.head(run)
    versions = await state.index.versions(run)
    touches = await state.index.blob_touches(run)
    selection = select_versions(versions, current.version, body.keep_last)
    await state.index.drop_versions(run, list(selection.delete))
    for version in selection.delete:
        state.manifests.pop((run, version), None)
    return await state.blocking(
        state.ledger.retain, run, versions, current.version, selection, body.grace_s, touches
    )


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(board_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/healthz")
async def healthz(request: Request) -> dict[str, str]:
    return {"status": "ok", "instance": board_state(request).settings.instance}
