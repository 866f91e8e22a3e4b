"""Routes for operations: fleet heartbeats, retention, metrics and health."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from deltaboard.board.contract.schemas import FleetNode, Heartbeat, RetentionPolicy, RetentionReport
from deltaboard.board.server.api.errors import documented
from deltaboard.board.server.api.routing import INPUT_ERRORS, RUN_ERRORS, BoardRoute
from deltaboard.board.server.api.state import Admin, BoardState, Reader, RunPath, board_state

router = APIRouter(route_class=BoardRoute)

POST_ERRORS = documented(*RUN_ERRORS, *INPUT_ERRORS)


@router.post("/v1/runs/{run}/fleet", status_code=204, responses=POST_ERRORS)
async def heartbeat(run: RunPath, body: Heartbeat, state: BoardState = Reader) -> Response:
    await state.service.heartbeat(run, body)
    return Response(status_code=204)


@router.get("/v1/runs/{run}/fleet", response_model=list[FleetNode], responses=documented(*RUN_ERRORS))
async def fleet(run: RunPath, state: BoardState = Reader) -> list[FleetNode]:
    return await state.service.fleet(run)


@router.post("/v1/runs/{run}/retention", response_model=RetentionReport, responses=POST_ERRORS)
async def retention(run: RunPath, body: RetentionPolicy, state: BoardState = Admin) -> RetentionReport:
    return await state.service.retain(run, body)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(board_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/healthz")
async def healthz(request: Request) -> dict[str, str]:
    return {"status": "ok", "instance": board_state(request).settings.instance}
