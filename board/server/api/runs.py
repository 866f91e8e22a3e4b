"""Routes for runs, their assets and the publisher's lease."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from deltaboard.board.contract.errors import AuthError, ErrorCode, InvalidRequest
from deltaboard.board.contract.schemas import (
    ASSET_NAME_RE,
    Lease,
    LeaseRenew,
    LeaseRequest,
    RunCreate,
    RunInfo,
)
from deltaboard.board.server.api.state import BoardState, Publisher, Reader
from deltaboard.board.server.api.uploads import receive_to_file

router = APIRouter(prefix="/v1/runs")


def check_asset_name(name: str) -> None:
    if not ASSET_NAME_RE.match(name):
        raise InvalidRequest(
            "asset names are 1-2 path segments of [A-Za-z0-9._-], no '..'", code=ErrorCode.BAD_ASSET_NAME
        )


@router.post("", status_code=201, response_model=RunInfo)
async def create_run(body: RunCreate, request: Request, state: BoardState = Publisher) -> JSONResponse:
    state.auth.check(request.headers.get("authorization"), "publish", body.name)
    info, created = await state.service.create_run(body)
    return JSONResponse(info.model_dump(mode="json"), status_code=201 if created else 200)


@router.get("", response_model=list[RunInfo])
async def list_runs(request: Request, state: BoardState = Reader) -> list[RunInfo]:
    authorization = request.headers.get("authorization")
    readable = []
    for record in await state.service.list_runs():
        try:
            state.auth.check(authorization, "read", record.name)
        except AuthError:
            continue
        readable.append(await state.service.run_info(record))
    return readable


@router.get("/{run}", response_model=RunInfo)
async def get_run(run: str, state: BoardState = Reader) -> RunInfo:
    return await state.service.get_run(run)


@router.put("/{run}/assets/{name:path}", status_code=201)
async def put_asset(
    run: str, name: str, request: Request, state: BoardState = Publisher
) -> dict[str, object]:
    check_asset_name(name)
    await state.service.require_run(run)
    received = await receive_to_file(request, state.settings.tmp_dir, state.settings.max_body_bytes)
    try:
        await state.service.put_asset(run, name, received.path)
    finally:
        received.path.unlink(missing_ok=True)
    return {"name": name, "size": received.size, "sha256": received.sha256}


@router.get("/{run}/assets/{name:path}", response_model=None)
async def get_asset(run: str, name: str, state: BoardState = Reader) -> Response:
    check_asset_name(name)
    found = await state.service.asset(run, name)
    if isinstance(found, bytes):
        return Response(found, media_type="application/octet-stream")
    return FileResponse(found, media_type="application/octet-stream")


@router.post("/{run}/lease", status_code=201, response_model=Lease)
async def acquire_lease(run: str, body: LeaseRequest, state: BoardState = Publisher) -> Lease:
    return await state.service.acquire_lease(run, body)


@router.post("/{run}/lease/renew", response_model=Lease)
async def renew_lease(run: str, body: LeaseRenew, state: BoardState = Publisher) -> Lease:
    return await state.service.renew_lease(run, body)


@router.delete("/{run}/lease", status_code=204)
async def release_lease(
    run: str,
    holder: str = Query(min_length=1, max_length=256),
    epoch: int = Query(ge=0),
    state: BoardState = Publisher,
) -> Response:
    await state.service.release_lease(run, holder, epoch)
    return Response(status_code=204)
