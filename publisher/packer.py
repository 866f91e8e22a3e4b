"""Pack tensor patches into content-addressed blobs and upload them in the background.

Most patches of a delta are a few KB: one blob per tensor would cost one request per
tensor and per follower. Patches are appended to an open blob until it would pass
`blob_max_bytes`; a sealed blob is hashed and handed to a small upload pool while
encoding goes on. The bytes held by sealed-but-unsent blobs are capped at
`max_pending_bytes` (at least one blob is always admitted), so a slow link makes the
encoder wait instead of buffering a whole keyframe in memory.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

Upload = Callable[[str, bytes], None]


@dataclass(frozen=True)
class TensorPart:
    """One tensor of a version as a rank produced it: everything but its shard file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str  # the blob holding its patch, at `offset`, `length` bytes
    offset: int
    length: int
    digest: str
    changed: int


@dataclass
class _Pending:
    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str
    changed: int
    offset: int
    length: int


class BlobPacker:
    """Accumulates patches into blobs; `finish()` returns the placed parts once all uploaded."""

    def __init__(
        self,
        upload: Upload,
        pool: ThreadPoolExecutor,
        *,
        blob_max_bytes: int,
        max_pending_bytes: int,
        on_uploaded: Callable[[int], None] | None = None,
    ) -> None:
        self._upload = upload
        self._pool = pool
        self._blob_max = blob_max_bytes
        self._max_pending = max_pending_bytes
        self._on_uploaded = on_uploaded
        self._chunks: list[bytes] = []
        self._open: list[_Pending] = []
        self._open_bytes = 0
        self._parts: list[TensorPart] = []
        self._futures: list[Future[None]] = []
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def add(
        self, name: str, dtype: str, shape: tuple[int, ...], patch: bytes, digest: str, changed: int
    ) -> None:
        if self._open and self._open_bytes + len(patch) > self._blob_max:
            self._seal()
        self._open.append(_Pending(name, dtype, shape, digest, changed, self._open_bytes, len(patch)))
        self._chunks.append(patch)
        self._open_bytes += len(patch)

    def finish(self) -> list[TensorPart]:
        """Seal the open blob, wait for every upload, return the parts (first error raised)."""
        if self._open:
            self._seal()
        for fut in self._futures:
            fut.exception()
        self._raise_if_failed()
        return self._parts

    def _raise_if_failed(self) -> None:
        with self._cond:
            if self._error is not None:
                raise self._error

    def _seal(self) -> None:
        # a failed upload stops the version here, at the next blob (not at every patch: a
        # blob may hold thousands)
        self._raise_if_failed()
        data = b"".join(self._chunks)
        sha = hashlib.sha256(data).hexdigest()
        self._parts.extend(
            TensorPart(p.name, p.dtype, p.shape, sha, p.offset, p.length, p.digest, p.changed)
            for p in self._open
        )
        self._chunks, self._open, self._open_bytes = [], [], 0
        with self._cond:
            while self._pending_bytes and self._pending_bytes + len(data) > self._max_pending:
                self._cond.wait()
            self._pending_bytes += len(data)
        self._futures.append(self._pool.submit(self._send, sha, data))

    def _send(self, sha: str, data: bytes) -> None:
        try:
            self._upload(sha, data)
            if self._on_uploaded is not None:
                self._on_uploaded(len(data))
        except BaseException as exc:
            with self._cond:
                self._error = self._error or exc
            raise
        finally:
            with self._cond:
                self._pending_bytes -= len(data)
                self._cond.notify_all()
