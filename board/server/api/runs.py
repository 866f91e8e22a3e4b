"""Routes for runs, their assets and the publisher's lease."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from deltaboard.board.contract.errors import BoardError, bad_request, not_found
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
from deltaboard.board.server.records import RunRecord
from deltaboard.board.server.storage import ObjectNotFound, asset_key

router = APIRouter(prefix="/v1/runs")


async def run_info(state: BoardState, record: RunRecord) -> RunInfo:
    prefix = asset_key(record.name, "")
    keys = await state.blocking(lambda: [info.key for info in state.store.list(prefix)])
    head = await state.head(record.name)
    return record.info(head.version, tuple(k[len(prefix) :] for k in keys))


def check_asset_name(name: str) -> None:
    if not ASSET_NAME_RE.match(name):
        raise bad_request("BadAssetName", "asset names are 1-2 path segments of [A-Za-z0-9._-], no '..'")


@router.post("", status_code=201, response_model=RunInfo)
async def create_run(body: RunCreate, request: Request, state: BoardState = Publisher) -> JSONResponse:
    state.auth.check(request.headers.get("authorization"), "publish", body.name)
    record, created = await state.blocking(state.ledger.create_run, body)
    await state.index.put_run(record)
    head, _ = await state.blocking(state.ledger.head, body.name)
    await state.index.advance_head(head.wire(body.name))
    info = await run_info(state, record)
    return JSONResponse(info.model_dump(mode="json"), status_code=201 if created else 200)


@router.get("", response_model=list[RunInfo])
async def list_runs(request: Request, state: BoardState = Reader) -> list[RunInfo]:
    authorization = request.headers.get("authorization")
    readable = []
    for record in await state.index.list_runs():
        try:
            state.auth.check(authorization, "read", record.name)
        except BoardError:
            continue
        readable.append(await run_info(state, record))
    return readable


@router.get("/{run}", response_model=RunInfo)
async def get_run(run: str, state: BoardState = Reader) -> RunInfo:
    return await run_info(state, await state.require_run(run))


@router.put("/{run}/assets/{name:path}", status_code=201)
async def put_asset(
    run: str, name: str, request: Request, state: BoardState = Publisher
) -> dict[str, object]:
    check_asset_name(name)
    await state.require_run(run)
    received = await receive_to_file(request, state.settings.tmp_dir, state.settings.max_body_bytes)
    try:
        await state.blocking(state.store.put_file, asset_key(run, name), received.path)
    finally:
        received.path.unlink(missing_ok=True)
    return {"name": name, "size": received.size, "sha256": received.sha256}


@router.get("/{run}/assets/{name:path}", response_model=None)
async def get_asset(run: str, name: str, state: BoardState = Reader) -> Response:
    check_asset_name(name)
    await state.require_run(run)
    key = asset_key(run, name)
    path = state.store.local_path(key)
    if path is not None:
        if not path.is_file():
            raise not_found("UnknownAsset", f"asset {name!r} does not exist")
        return FileResponse(path, media_type="application/octet-stream")
    try:
        data = await state.blocking(state.store.get, key)
    except ObjectNotFound:
        raise not_found("UnknownAsset", f"asset {name!r} does not exist") from None
    return Response(data, media_type="application/octet-stream")


@router.post("/{run}/lease", status_code=201, response_model=Lease)
async def acquire_lease(run: str, body: LeaseRequest, state: BoardState = Publisher) -> Lease:
    await state.require_run(run)
    lease, head = await state.blocking(state.ledger.acquire_lease, run, body)
    await state.index.advance_head(head.wire(run))
    return lease


@router.post("/{run}/lease/renew", response_model=Lease)
async def renew_lease(run: str, body: LeaseRenew, state: BoardState = Publisher) -> Lease:
    await state.require_run(run)
    return await state.blocking(state.ledger.renew_lease, run, body)


@router.delete("/{run}/lease", status_code=204)
async def release_lease(
    run: str,
    holder: str = Query(min_length=1, max_length=256),
    epoch: int = Query(ge=0),
    state: BoardState = Publisher,
) -> Response:
    await state.require_run(run)
    await state.blocking(state.ledger.release_lease, run, holder, epoch)
    return Response(status_code=204)
