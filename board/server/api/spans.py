"""Routes for spans and worker keyframes: register one (compact scope, which publish
includes: the compaction worker's token may register derived data but not commit) and
read one's manifest back."""

from __future__ import annotations

from fastapi import APIRouter, Path
from fastapi.responses import JSONResponse, Response

from deltaboard.board.contract.schemas import MAX_VERSION
from deltaboard.board.contract.spans import KeyframeManifest, KeyframeRegistered, SpanManifest, SpanRegistered
from deltaboard.board.server.api.errors import documented
from deltaboard.board.server.api.routing import INPUT_ERRORS, RUN_ERRORS, BoardRoute
from deltaboard.board.server.api.state import BoardState, Compactor, Reader, RunPath

router = APIRouter(prefix="/v1/runs/{run}", route_class=BoardRoute)


@router.post(
    "/spans",
    status_code=201,
    response_model=SpanRegistered,
    responses={
        200: {"model": SpanRegistered, "description": "already stored"},
        **documented(*RUN_ERRORS, *INPUT_ERRORS),
    },
)
async def register(run: RunPath, body: SpanManifest, state: BoardState = Compactor) -> JSONResponse:
    """Store a span checked against the committed manifests of its ends (201), or answer
    the one stored already with the same ends (200): registering is idempotent."""
    registered = await state.service.spans.register(run, body)
    return JSONResponse(registered.model_dump(mode="json"), status_code=201 if registered.created else 200)


@router.get(
    "/spans/{from_version}/{to_version}",
    response_class=Response,
    responses={200: {"model": SpanManifest, "description": "the span, as stored"}, **documented(*RUN_ERRORS)},
)
async def span(
    run: RunPath,
    from_version: int = Path(ge=0, le=MAX_VERSION),
    to_version: int = Path(ge=0, le=MAX_VERSION),
    state: BoardState = Reader,
) -> Response:
    return _immutable(await state.service.spans.manifest(run, from_version, to_version))


@router.post(
    "/keyframes",
    status_code=201,
    response_model=KeyframeRegistered,
    responses={
        200: {"model": KeyframeRegistered, "description": "already stored"},
        **documented(*RUN_ERRORS, *INPUT_ERRORS),
    },
)
async def register_keyframe(
    run: RunPath, body: KeyframeManifest, state: BoardState = Compactor
) -> JSONResponse:
    """Store a worker keyframe checked against the committed manifests up to its version
    (201), or answer the one stored already for that version (200)."""
    registered = await state.service.spans.register_keyframe(run, body)
    return JSONResponse(registered.model_dump(mode="json"), status_code=201 if registered.created else 200)


@router.get(
    "/keyframes/{version}",
    response_class=Response,
    responses={
        200: {"model": KeyframeManifest, "description": "the keyframe, as stored"},
        **documented(*RUN_ERRORS),
    },
)
async def keyframe(
    run: RunPath, version: int = Path(ge=0, le=MAX_VERSION), state: BoardState = Reader
) -> Response:
    return _immutable(await state.service.spans.keyframe(run, version))


def _immutable(data: bytes) -> Response:
    """A stored manifest of derived data: named by its versions, never rewritten."""
    return Response(
        data, media_type="application/json", headers={"Cache-Control": "public, max-age=31536000, immutable"}
    )
