"""Streaming request bodies to a temporary file while hashing them.

A blob never sits whole in memory: chunks are gathered up to `FLUSH_BYTES`, then hashed and
written by a worker thread. Any failure (client gone, body short of its Content-Length,
too large) removes the temporary file, so nothing partial remains.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from deltaboard.board.contract.errors import BodyTooLarge, ErrorCode, InvalidRequest

FLUSH_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Received:
    path: Path
    size: int
    sha256: str


def _write(f: BinaryIO, digest: hashlib._Hash, chunks: list[bytes]) -> None:
    for chunk in chunks:
        digest.update(chunk)
        f.write(chunk)


async def receive_to_file(request: Request, tmp_dir: Path, max_bytes: int) -> Received:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise BodyTooLarge(f"bodies are limited to {max_bytes} bytes")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=tmp_dir, suffix=".upload")
    path = Path(name)
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            pending: list[bytes] = []
            pending_bytes = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(f"bodies are limited to {max_bytes} bytes")
                pending.append(chunk)
                pending_bytes += len(chunk)
                if pending_bytes >= FLUSH_BYTES:
                    await run_in_threadpool(_write, f, digest, pending)
                    pending, pending_bytes = [], 0
            await run_in_threadpool(_write, f, digest, pending)
        if declared is not None and size != int(declared):
            raise InvalidRequest(
                f"received {size} of {declared} declared bytes", code=ErrorCode.INCOMPLETE_BODY
            )
    except ClientDisconnect:
        path.unlink(missing_ok=True)
        raise InvalidRequest(
            "the client went away before the body was complete", code=ErrorCode.INCOMPLETE_BODY
        ) from None
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return Received(path=path, size=size, sha256=digest.hexdigest())
