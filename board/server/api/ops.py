"""Routes for operations: fleet heartbeats, retention, metrics and health."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from deltaboard.board.contract.schemas import FleetNode, Heartbeat, RetentionPolicy, RetentionReport
from deltaboard.board.server.api.state import Admin, BoardState, Reader, board_state

router = APIRouter()


@router.post("/v1/runs/{run}/fleet", status_code=204)
async def heartbeat(run: str, body: Heartbeat, state: BoardState = Reader) -> Response:
    await state.service.heartbeat(run, body)
    return Response(status_code=204)


@router.get("/v1/runs/{run}/fleet", response_model=list[FleetNode])
async def fleet(run: str, state: BoardState = Reader) -> list[FleetNode]:
    return await state.service.fleet(run)


@router.post("/v1/runs/{run}/retention", response_model=RetentionReport)
async def retention(run: str, body: RetentionPolicy, state: BoardState = Admin) -> RetentionReport:
    return await state.service.retain(run, body)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(board_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/healthz")
async def healthz(request: Request) -> dict[str, str]:
    return {"status": "ok", "instance": board_state(request).settings.instance}
