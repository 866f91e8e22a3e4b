"""Routes for runs, their assets and the publisher's lease."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from deltaboard.board.contract.errors import AuthError
from deltaboard.board.contract.schemas import Lease, LeaseRenew, LeaseRequest, RunCreate, RunInfo, StoredAsset
from deltaboard.board.server.api.errors import documented
from deltaboard.board.server.api.routing import BINARY, INPUT_ERRORS, RAW_UPLOAD, RUN_ERRORS, BoardRoute
from deltaboard.board.server.api.state import (
    AssetPath,
    BoardState,
    Publisher,
    Reader,
    RunPath,
    check_asset_name,
)
from deltaboard.board.server.api.uploads import receive_to_file

router = APIRouter(prefix="/v1/runs", route_class=BoardRoute)

LEASE_ERRORS = documented(*RUN_ERRORS, 409, *INPUT_ERRORS)


@router.post(
    "",
    status_code=201,
    response_model=RunInfo,
    responses={
        200: {"model": RunInfo, "description": "the run existed already"},
        **documented(400, 401, 403, 422, 503, *INPUT_ERRORS),
    },
)
async def create_run(body: RunCreate, request: Request, state: BoardState = Publisher) -> JSONResponse:
    state.auth.check(request.headers.get("authorization"), "publish", body.name)
    info, created = await state.service.create_run(body)
    return JSONResponse(info.model_dump(mode="json"), status_code=201 if created else 200)


@router.get("", response_model=list[RunInfo], responses=documented(401, 403, 503))
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


@router.get("/{run}", response_model=RunInfo, responses=documented(*RUN_ERRORS))
async def get_run(run: RunPath, state: BoardState = Reader) -> RunInfo:
    return await state.service.get_run(run)


@router.put("/{run}/assets/{name:path}", response_model=StoredAsset, **RAW_UPLOAD)
async def put_asset(
    run: RunPath, name: AssetPath, request: Request, state: BoardState = Publisher
) -> StoredAsset:
    check_asset_name(name)
    await state.service.require_run(run)
    received = await receive_to_file(request, state.settings.tmp_dir, state.settings.max_body_bytes)
    try:
        await state.service.put_asset(run, name, received.path)
    finally:
        received.path.unlink(missing_ok=True)
    return StoredAsset(name=name, size=received.size, sha256=received.sha256)


@router.get(
    "/{run}/assets/{name:path}",
    response_class=Response,
    responses={200: {"content": BINARY, "description": "the asset's bytes"}, **documented(*RUN_ERRORS)},
)
async def get_asset(run: RunPath, name: AssetPath, state: BoardState = Reader) -> Response:
    check_asset_name(name)
    found = await state.service.asset(run, name)
    if isinstance(found, bytes):
        return Response(found, media_type="application/octet-stream")
    return FileResponse(found, media_type="application/octet-stream")


@router.post("/{run}/lease", status_code=201, response_model=Lease, responses=LEASE_ERRORS)
async def acquire_lease(run: RunPath, body: LeaseRequest, state: BoardState = Publisher) -> Lease:
    return await state.service.acquire_lease(run, body)


@router.post("/{run}/lease/renew", response_model=Lease, responses=LEASE_ERRORS)
async def renew_lease(run: RunPath, body: LeaseRenew, state: BoardState = Publisher) -> Lease:
    return await state.service.renew_lease(run, body)


@router.delete("/{run}/lease", status_code=204, responses=documented(*RUN_ERRORS, 409))
async def release_lease(
    run: RunPath,
    holder: str = Query(min_length=1, max_length=256),
    epoch: int = Query(ge=0),
    state: BoardState = Publisher,
) -> Response:
    await state.service.release_lease(run, holder, epoch)
    return Response(status_code=204)
