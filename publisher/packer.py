"""Pack tensor patches into content-addressed blobs and upload them in the background.

Most patches of a delta are a few KB: one blob per tensor would cost one request per
tensor and per follower. Patches are appended to an open blob until it would pass
`blob_max_bytes`; a sealed blob is hashed and handed to a small upload pool while
encoding goes on. The bytes held by sealed-but-unsent blobs are capped at
`max_pending_bytes` (at least one blob is always admitted), so a slow link makes the
encoder wait instead of buffering a whole keyframe in memory.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

Upload = Callable[[str, bytes], None]


@dataclass(frozen=True)
class Tensors:
    """The tensors of a run of patches, as the packer takes them: columns (a bundle of
    thousands of small tensors is four lists, not a tuple per tensor, and the packer
    extends its own columns with runs of them)."""

    names: Sequence[str]
    dtypes: Sequence[str]
    shapes: Sequence[tuple[int, ...]]
    changed: Sequence[int]  # elements changed (a keyframe's: all)


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
class PackedParts:
    """The tensors a packer placed, as columns: a model of 20,000 tensors is then a few
    lists, not an object per tensor, from the encoder to the manifest's columns (which
    have the same shape). Part i lies in blob `blobs[blob[i]]`; iterating gives each part
    as a `TensorPart`."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)
    blobs: list[str] = field(default_factory=list)  # each blob's sha256, once
    blob: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[TensorPart]:
        columns = (self.names, self.dtypes, self.shapes, self.blob, self.offsets, self.lengths)
        for (name, dtype, shape, blob, offset, length), digest, changed in zip(
            zip(*columns, strict=True), self.digests, self.changed, strict=True
        ):
            yield TensorPart(name, dtype, shape, self.blobs[blob], offset, length, digest, changed)

    @classmethod
    def joined(cls, many: Sequence[PackedParts]) -> PackedParts:
        """Several packers' parts one after the other (each rank's, in rank order)."""
        out = cls()
        for parts in many:
            out.blob += [len(out.blobs) + b for b in parts.blob]
            out.blobs += parts.blobs
            for column in _PER_PART[:-1]:
                getattr(out, column).extend(getattr(parts, column))
        return out

    def take(self, order: Sequence[int]) -> PackedParts:
        """The parts at the indices `order`, in that order (in the same blobs)."""
        picked = {column: [getattr(self, column)[i] for i in order] for column in _PER_PART}
        return PackedParts(**picked, blobs=self.blobs)


_PER_PART = ("names", "dtypes", "shapes", "digests", "changed", "offsets", "lengths", "blob")


class BlobPacker:
    """Accumulates patches into blobs; `finish()` returns the placed parts once all uploaded
    (`seal()` then `wait()`)."""

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
        self._chunks: list[bytes | memoryview] = []
        self._open = 0  # parts in the open blob (the last ones of `_parts`)
        self._open_bytes = 0
        self._parts = PackedParts()
        self._futures: list[Future[None]] = []
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def add(self, tensors: Tensors, data: bytes, ends: Sequence[int], digests: Sequence[str]) -> None:
        """Patches end to end in `data` (patch i ends at `ends[i]`), of `tensors` in order,
        with their result digests.

        A patch goes to the open blob unless it would take it past `blob_max_bytes` (then
        the blob is sealed first; a larger patch gets a blob of its own): a run of patches
        that fits is appended as one piece of `data`, and its tensors as runs of the
        columns, so a batch of many small patches costs a few list extensions, not a step
        per patch."""
        view = memoryview(data)
        starts = [0, *ends[:-1]]
        i = 0
        while i < len(ends):
            start = starts[i]
            room = self._blob_max - self._open_bytes
            stop = bisect.bisect_right(ends, start + room, lo=i)  # patches i..stop-1 fit
            if stop == i and self._open:
                self._seal()
                continue
            stop = max(stop, i + 1)
            at = self._open_bytes - start
            parts = self._parts
            parts.names += tensors.names[i:stop]
            parts.dtypes += tensors.dtypes[i:stop]
            parts.shapes += tensors.shapes[i:stop]
            parts.changed += tensors.changed[i:stop]
            parts.digests += digests[i:stop]
            parts.offsets += [at + first for first in starts[i:stop]]
            parts.lengths += [end - first for first, end in zip(starts[i:stop], ends[i:stop], strict=True)]
            self._chunks.append(view[start : ends[stop - 1]])
            self._open += stop - i
            self._open_bytes += ends[stop - 1] - start
            i = stop

    def finish(self) -> PackedParts:
        """Seal the open blob, wait for every upload, return the parts (first error raised)."""
        parts = self.seal()
        self.wait()
        return parts

    def seal(self) -> PackedParts:
        """Seal the open blob and return the parts, every one placed, while the last blobs
        may still be uploading (`wait`): what follows from the parts alone (a manifest)
        can be made meanwhile."""
        if self._open:
            self._seal()
        return self._parts

    def wait(self) -> None:
        """Wait for every upload (the first error raised)."""
        for fut in self._futures:
            fut.exception()
        self._raise_if_failed()

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
        self._parts.blob += [len(self._parts.blobs)] * self._open
        self._parts.blobs.append(sha)
        self._chunks, self._open, self._open_bytes = [], 0, 0
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
