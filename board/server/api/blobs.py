"""Routes for content-addressed blobs: upload targets (deduplicated by sha256), the
board-proxied streaming upload, and downloads with Range, ETag and immutable caching
(a redirect to a presigned URL when the store has one)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, RedirectResponse
from starlette.datastructures import MutableHeaders
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.types import Receive, Scope, Send

from deltaboard.board.contract.errors import ErrorCode, InvalidRequest, UnknownBlob
from deltaboard.board.contract.schemas import BlobSize, BlobUploadTarget
from deltaboard.board.server.api.errors import documented
from deltaboard.board.server.api.routing import BINARY, INPUT_ERRORS, RAW_UPLOAD, RUN_ERRORS, BoardRoute
from deltaboard.board.server.api.state import BoardState, Compactor, Reader, RunPath, ShaPath, check_sha
from deltaboard.board.server.api.uploads import receive_to_file
from deltaboard.board.server.api.zerocopy import ZEROCOPY

router = APIRouter(prefix="/v1/runs/{run}/blobs", route_class=BoardRoute)

DOWNLOAD_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": BINARY, "description": "the blob (HEAD: its size)"},
    206: {"content": BINARY, "description": "the requested range"},
    304: {"description": "unchanged (If-None-Match)"},
    307: {"description": "a presigned URL of the store holds it (S3; GET only)"},
    **documented(*RUN_ERRORS, 416),
}

IMMUTABLE = "public, max-age=31536000, immutable"


# Threads that read blob chunks for the downloads that cannot leave by `sendfile` (several
# ranges in one answer, or a server without `zerocopy`), whatever their number: each
# thread that wakes with a chunk must take the GIL back from the event loop, and a thread
# per download delayed commits (whose store work runs in threads too) and long-poll wakes
# with them (`bench board --mixed`); two keep the downloads' reads ahead of their sockets.
READ_THREADS = 2


class SharedReadFile(anyio.AsyncFile[bytes]):
    """An open blob whose reads run on the few `READ_THREADS`."""

    limiter: anyio.CapacityLimiter | None = None

    @classmethod
    def threads(cls) -> anyio.CapacityLimiter:
        if cls.limiter is None:
            cls.limiter = anyio.CapacityLimiter(READ_THREADS)
        return cls.limiter

    async def read(self, size: int = -1) -> bytes:
        return await anyio.to_thread.run_sync(self.wrapped.read, size, limiter=self.threads())

    async def seek(self, offset: int, whence: int | None = os.SEEK_SET) -> int:
        start = os.SEEK_SET if whence is None else whence
        return await anyio.to_thread.run_sync(self.wrapped.seek, offset, start, limiter=self.threads())


class BlobFileResponse(FileResponse):
    """Serves a file opened before the answer starts: retention may delete the blob at any
    moment, and a file reopened by name after the headers went out would break the answer
    half-way (an unlinked file stays readable through its open descriptor). The whole blob
    or one range leaves by `sendfile` where the server offers `zerocopy`, off the event
    loop; otherwise (and for several ranges) in reads larger than Starlette's 64 KiB
    default: fewer event-loop turns per GB."""

    chunk_size = 1024 * 1024

    def __init__(self, path: Path, file: BinaryIO, headers: dict[str, str]) -> None:
        self._file = file
        self._zerocopy = False
        super().__init__(
            path, media_type="application/octet-stream", headers=headers, stat_result=os.fstat(file.fileno())
        )

    @contextlib.asynccontextmanager
    async def _open_file(self) -> AsyncIterator[anyio.AsyncFile[bytes]]:
        yield SharedReadFile(self._file)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._zerocopy = ZEROCOPY in scope.get("extensions", {})
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._file.close()

    async def _send_range(
        self, send: Send, status: int, headers: list[tuple[bytes, bytes]], start: int, end: int
    ) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": ZEROCOPY, "file": self._file, "offset": start, "count": end - start})

    async def _handle_simple(self, send: Send, send_header_only: bool, send_pathsend: bool) -> None:
        if not self._zerocopy or send_header_only:
            await super()._handle_simple(send, send_header_only, send_pathsend)
            return
        size = int(self.headers["content-length"])
        await self._send_range(send, self.status_code, self.raw_headers, 0, size)

    async def _handle_single_range(
        self, send: Send, start: int, end: int, file_size: int, send_header_only: bool
    ) -> None:
        if not self._zerocopy or send_header_only:
            await super()._handle_single_range(send, start, end, file_size, send_header_only)
            return
        headers = MutableHeaders(raw=list(self.raw_headers))
        headers["content-range"] = f"bytes {start}-{end - 1}/{file_size}"
        headers["content-length"] = str(end - start)
        await self._send_range(send, 206, headers.raw, start, end)

    def check_range(self, header: str | None) -> None:
        """Refuse a bad `Range` with a JSON error, as every other failure (Starlette would
        answer in plain text)."""
        if header is None:
            return
        size = int(self.headers["content-length"])
        try:
            self._parse_range_header(header, size)
        except MalformedRangeHeader as e:
            self._file.close()
            raise InvalidRequest(f"malformed Range header: {e.content}", code=ErrorCode.BAD_RANGE) from None
        except RangeNotSatisfiable:
            self._file.close()
            raise InvalidRequest(
                f"the blob has {size} bytes", code=ErrorCode.RANGE_NOT_SATISFIABLE, size=size
            ) from None


@router.post(
    "/{sha256}/upload", response_model=BlobUploadTarget, responses=documented(*RUN_ERRORS, *INPUT_ERRORS)
)
async def upload_target(
    run: RunPath, sha256: ShaPath, size: int = Query(ge=0), state: BoardState = Compactor
) -> BlobUploadTarget:
    check_sha(sha256)
    return await state.service.upload_target(run, sha256, size)


@router.put("/{sha256}", response_model=BlobSize, **RAW_UPLOAD)
async def put_blob(
    run: RunPath, sha256: ShaPath, request: Request, state: BoardState = Compactor
) -> BlobSize:
    check_sha(sha256)
    await state.service.require_run(run)
    received = await receive_to_file(request, state.settings.tmp_dir, state.settings.max_blob_bytes)
    try:
        await state.service.put_blob(run, sha256, received.path, received.size, received.sha256)
    finally:
        received.path.unlink(missing_ok=True)
    return BlobSize(sha256=sha256, size=received.size)


@router.get("/{sha256}", response_class=Response, responses=DOWNLOAD_RESPONSES)
@router.head("/{sha256}", response_class=Response, responses=DOWNLOAD_RESPONSES, operation_id="head_blob")
async def get_blob(run: RunPath, sha256: ShaPath, request: Request, state: BoardState = Reader) -> Response:
    check_sha(sha256)
    await state.service.require_run(run)
    etag = f'"{sha256}"'
    path = state.service.local_blob(run, sha256)
    if path is None:
        # A presigned GET URL does not sign HEAD: answer HEAD here.
        size, url = await state.service.remote_blob(run, sha256, presign=request.method != "HEAD")
        if url is None:
            headers = {"ETag": etag, "Cache-Control": IMMUTABLE, "Content-Length": str(size)}
            return Response(status_code=200, headers=headers, media_type="application/octet-stream")
        return RedirectResponse(url, status_code=307, headers={"ETag": etag})
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE}
    if request.headers.get("if-none-match") in (etag, "*"):
        if not path.is_file():
            raise UnknownBlob(f"blob {sha256} is not stored")
        return Response(status_code=304, headers=headers)
    try:
        file = open(path, "rb")  # noqa: SIM115 (closed by the response)
    except FileNotFoundError:
        raise UnknownBlob(f"blob {sha256} is not stored") from None
    response = BlobFileResponse(path, file, headers)
    if "if-range" not in request.headers:  # with If-Range, a stale validator ignores the range
        response.check_range(request.headers.get("range"))
    if request.method == "GET" and "range" not in request.headers:
        state.metrics.blob_bytes_out.inc(int(response.headers["content-length"]))
    return response
