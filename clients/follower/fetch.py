"""Parallel, resumable, verified downloads of a plan's blobs into the local cache.

Each blob is streamed by `BoardClient.download_blob` into `cache/blobs/{sha}.part`, resumed
with `Range` after an interruption (also one from a killed process), and renamed to
`{sha}` only once its sha256 matched: a file named by its sha256 in the cache is
therefore always complete and authentic. Transport failures and 5xx answers are retried
with exponential backoff (the client retries single requests; this retries whole
downloads, which resume where they stopped). A blob whose bytes hash wrong is discarded
and fetched once more; a second mismatch is an `IntegrityError`.

A large blob (at least two `RANGE_BYTES` pieces) is fetched as ranges instead, each on a
connection of its own, written at its offset into `{sha}.ranges` and hashed once all are
there: one stream is bound by its connection and by the hash beside it (on loopback about
0.4 GB/s), which on a hot update of a large view was a fifth of the time from commit to
serving. A ranged file is never resumed (it has holes until it is done): a failure or a
leftover from a killed process is discarded, and the blob is fetched whole as above, a
ranged mismatch counting as the first.

Derived data (a worker keyframe, a span) is not cached by an update: `RangedReader` fetches
each tensor's range when the apply asks for it, on the apply's threads, so ranges download
in parallel and each is decoded and written as soon as it arrives (a new node writes its
shards once, with no copy of the blob on disk; a node catching up decodes the first
tensors of a span while the rest download); on a plain HTTP board each thread reads its
ranges on a connection of its own into a buffer it reuses (`ranges.PlainRanges`), the
client's httpx path taking any other answer. A span whose blob is in the cache (downloaded
ahead by `Follower.fetch`, or again after a patch of it failed to decode) is read from there.
Each range is one patch, checked by the patch's own checksum (the header's xxh3
over every byte of the range), fetched once more on a mismatch, and a second mismatch is
an `IntegrityError`. The entry's `range_sha256` is not checked: it would prove the same
bytes a second time, for several times the CPU of the checksum, on the path that bounds a
new node (docs/design.md, "Bootstrap at link speed"); what proves the decoded tensor is
the trainer's is its digest, checked against the trainer's manifest as for any keyframe
or delta.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Literal, Protocol

import httpx

from deltaboard.board import codec
from deltaboard.board.contract.errors import BoardError, BoardUnavailable
from deltaboard.board.contract.schemas import BlobRef, BlobSize, TensorEntry
from deltaboard.clients.board_client import BlobIntegrityError, BoardClient
from deltaboard.clients.follower.errors import FollowerError, IntegrityError
from deltaboard.clients.follower.ranges import PlainRanges

ByteProgress = Callable[[int], None]
log = logging.getLogger("deltaboard.follower")
Outcome = Literal["cached", "mismatch", "failed"]  # of a blob fetched by ranges

RANGE_BYTES = 8 * 2**20
RANGED_WORKERS = 8  # connections for a blob by ranges: loopback and WAN links alike fill with a few
_PARTIAL = (".part", ".ranges")


class BlobCache:
    """Verified blobs on local disk, by sha256."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, sha: str) -> Path:
        return self.directory / sha

    def has(self, sha: str) -> bool:
        return self.path(sha).exists()

    def streamed(self, sha: str) -> Path:
        """Where a streamed download grows (resumed from where it stopped)."""
        return self.path(sha).with_name(sha + ".part")

    def ranged(self, sha: str) -> Path:
        """Where a blob fetched by ranges is assembled (never resumed: it has holes)."""
        return self.path(sha).with_name(sha + ".ranges")

    def discard(self, sha: str) -> None:
        for path in (self.path(sha), self.streamed(sha), self.ranged(sha)):
            path.unlink(missing_ok=True)

    def keep_only(self, shas: set[str]) -> None:
        """Delete every cached blob (and partial download) not named in `shas`."""
        for path in self.directory.iterdir():
            name = path.name
            for suffix in _PARTIAL:
                name = name.removesuffix(suffix)
            if name not in shas:
                path.unlink(missing_ok=True)


class PatchSource(Protocol):
    """Where an apply reads each entry's patch bytes."""

    def read(self, ref: BlobRef) -> memoryview: ...


class BlobReader:
    """Zero-copy slices of cached blobs (each blob mapped once) for the codec to decode."""

    def __init__(self, cache: BlobCache) -> None:
        self._cache = cache
        self._maps: dict[str, mmap.mmap] = {}

    def read(self, ref: BlobRef) -> memoryview:
        """Bytes [offset, offset + length) of a cached blob."""
        mapped = self._maps.get(ref.sha256)
        if mapped is None:
            with open(self._cache.path(ref.sha256), "rb") as f:
                if not os.fstat(f.fileno()).st_size:
                    raise IntegrityError(f"cached blob {ref.sha256[:12]} is empty")
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[ref.sha256] = mapped
        if ref.offset + ref.length > len(mapped):
            raise IntegrityError(f"blob {ref.sha256[:12]} is shorter than the manifest's range")
        return memoryview(mapped)[ref.offset : ref.offset + ref.length]

    def close(self) -> None:
        """Drop the mappings; each unmaps once the last slice of it is gone (a slice may
        outlive this in an exception's traceback, so they are not closed by force)."""
        self._maps.clear()

    def __enter__(self) -> BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Fetcher:
    """Downloads blobs of one run into a `BlobCache`, `workers` at a time."""

    def __init__(
        self,
        board: BoardClient,
        run: str,
        cache: BlobCache,
        *,
        workers: int = 4,
        attempts: int = 4,
        backoff_s: float = 0.5,
    ) -> None:
        self.board = board
        self.run = run
        self.cache = cache
        self.workers = workers
        self.attempts = attempts
        self.backoff_s = backoff_s

    def missing(self, blobs: Iterable[BlobSize]) -> list[BlobSize]:
        """Blobs not yet in the cache, each once."""
        unique = {b.sha256: b for b in blobs}
        return [b for b in unique.values() if not self.cache.has(b.sha256)]

    def fetch(self, blobs: Iterable[BlobSize], progress: ByteProgress | None = None) -> None:
        """Make every blob present in the cache (`progress` receives downloaded bytes)."""
        todo = self.missing(blobs)
        if not todo:
            return
        # a large blob splits into ranges, unless an earlier stream left it half-way: that resumes
        ranged = [b for b in todo if b.size >= 2 * RANGE_BYTES and not self.cache.streamed(b.sha256).exists()]
        whole = [b for b in todo if b not in ranged]
        tasks = len(whole) + sum(-(-b.size // RANGE_BYTES) for b in ranged)
        threads = min(tasks, max(self.workers, RANGED_WORKERS if ranged else 0))
        plain = self.board.plain_http()
        ranges = None if plain is None else PlainRanges(*plain)
        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="deltaboard-fetch") as pool:
                streams = [pool.submit(self._fetch_one, b.sha256, progress) for b in whole]
                started = [(b, self._fetch_ranges(b, pool, ranges, progress)) for b in ranged]
                for blob, finish in started:
                    outcome = finish()
                    if outcome != "cached":
                        self._fetch_one(blob.sha256, progress, mismatches=int(outcome == "mismatch"))
                for stream in streams:
                    stream.result()
        finally:
            if ranges is not None:
                ranges.close()

    def refetch(self, sha: str, progress: ByteProgress | None = None) -> None:
        """Discard a cached blob that failed to decode or verify and download it again."""
        self.cache.discard(sha)
        self._fetch_one(sha, progress)

    def _fetch_ranges(
        self,
        blob: BlobSize,
        pool: ThreadPoolExecutor,
        ranges: PlainRanges | None,
        progress: ByteProgress | None,
    ) -> Callable[[], Outcome]:
        """Start fetching `blob`'s ranges on `pool`. The returned call waits for them and
        says what came of it: "cached" (hashed right, renamed into the cache), "mismatch"
        (hashed wrong) or "failed" (a range could not be fetched); in the last two nothing
        of it is left, nor counted in `progress`, and the caller fetches it whole."""
        target = self.cache.ranged(blob.sha256)
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, blob.size)
        path = self.board.blob_path(self.run, blob.sha256)
        written: list[int] = []  # list.append is atomic: the pieces' threads add to it

        def piece(start: int) -> None:
            end = min(blob.size, start + RANGE_BYTES)
            data: memoryview | bytes | None = None if ranges is None else ranges.read(path, start, end)
            if data is None:
                data = self.board.get_blob(self.run, blob.sha256, start, end)
            if len(data) != end - start:
                raise FollowerError(f"range {start}-{end} came back with {len(data)} bytes")
            view, at = memoryview(data), start
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
            written.append(end - start)
            if progress is not None:
                progress(end - start)

        pieces = [pool.submit(piece, start) for start in range(0, blob.size, RANGE_BYTES)]

        def finish() -> Outcome:
            outcome: Outcome = "failed"
            try:
                for future in pieces:
                    future.result()
                outcome = "cached" if _sha256(fd, blob.size) == blob.sha256 else "mismatch"
            except (BoardError, httpx.TransportError, FollowerError) as exc:
                log.info("blob %s by ranges failed (%s): fetching it whole", blob.sha256[:12], exc)
            finally:
                for future in pieces:
                    future.cancel()
                wait(pieces)  # no piece writes into the file once it is closed
                os.close(fd)
                if outcome == "cached":
                    os.replace(target, self.cache.path(blob.sha256))
                else:
                    target.unlink(missing_ok=True)
                    if progress is not None:
                        progress(-sum(written))
            return outcome

        return finish

    def _fetch_one(self, sha: str, progress: ByteProgress | None, *, mismatches: int = 0) -> None:
        last: Exception | None = None
        for attempt in range(self.attempts):
            try:
                self.board.download_blob(self.run, sha, self.cache.path(sha), progress=progress)
                return
            except BlobIntegrityError as exc:
                mismatches += 1
                if mismatches > 1:
                    raise IntegrityError(f"blob {sha[:12]} hashed wrong twice: {exc}") from exc
                continue
            except (BoardUnavailable, httpx.TransportError) as exc:
                last = exc
            except BoardError as exc:
                raise FollowerError(f"cannot fetch blob {sha[:12]}: {exc}") from exc
            time.sleep(self.backoff_s * 2**attempt)
        raise FollowerError(f"cannot fetch blob {sha[:12]} after {self.attempts} attempts: {last}")


class RangedReader:
    """The patches of derived entries (a worker keyframe's or a span's), each fetched by a
    ranged request when read (see the module docstring); `progress` receives the bytes
    downloaded."""

    def __init__(
        self,
        board: BoardClient,
        run: str,
        entries: Iterable[TensorEntry],
        progress: ByteProgress | None = None,
    ) -> None:
        self._board = board
        self._run = run
        self._ranges = {(t.blob.sha256, t.blob.offset, t.blob.length) for t in entries}
        self._progress = progress
        plain = board.plain_http()
        self._plain = None if plain is None else PlainRanges(*plain)

    def read(self, ref: BlobRef) -> memoryview:
        """The range's bytes, checked by the patch's checksum. Read on a plain connection
        they lie in this thread's buffer: valid until the thread's next read."""
        if (ref.sha256, ref.offset, ref.length) not in self._ranges:
            raise FollowerError(
                f"blob {ref.sha256[:12]} range {ref.offset}+{ref.length} is not one of the step's"
            )
        start, end = ref.offset, ref.offset + ref.length
        for _ in range(2):
            data = None
            if self._plain is not None:
                data = self._plain.read(self._board.blob_path(self._run, ref.sha256), start, end)
            if data is None:
                try:
                    data = memoryview(self._board.get_blob(self._run, ref.sha256, start, end))
                except BoardError as exc:
                    raise FollowerError(f"cannot fetch blob {ref.sha256[:12]}: {exc}") from exc
            if self._progress is not None:
                self._progress(len(data))
            if len(data) == ref.length and _intact(data):
                return data
        raise IntegrityError(
            f"blob {ref.sha256[:12]} range {ref.offset}+{ref.length} failed its checksum twice"
        )

    def close(self) -> None:
        """Close the plain connections (the apply's threads are done with them)."""
        if self._plain is not None:
            self._plain.close()


def _intact(patch: memoryview) -> bool:
    """Whether a patch's checksum covers its bytes (a truncated or flipped range fails)."""
    try:
        codec.read_header(patch)
    except codec.PatchError:
        return False
    return True


def _sha256(fd: int, size: int) -> str:
    """The sha256 of a file's first `size` bytes, read through a mapping (hashlib lets other
    threads run while it hashes)."""
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
        return hashlib.sha256(mapped).hexdigest()
