"""A large blob fetched as ranges on parallel connections, against a real board process.

`RANGE_BYTES` is set small so that a blob of a few hundred KiB splits into many ranges; the
board, its HTTP and the cache are the real ones. The faults (a range that fails, a blob
corrupted in the store, a leftover from a killed process) are injected.
"""

from __future__ import annotations

import hashlib
import os
import threading

import httpx
import pytest

from deltaboard.board.contract.schemas import BlobSize
from deltaboard.clients.follower import IntegrityError
from deltaboard.clients.follower import fetch as fetch_module
from deltaboard.clients.follower.fetch import BlobCache, Fetcher

PIECE = 4096


class Recording(httpx.HTTPTransport):
    """A real transport that records the Range of every blob GET and can fail the n-th
    ranged one with a dropped connection."""

    def __init__(self, fail_range: int | None = None) -> None:
        super().__init__()
        self.ranges: list[str] = []
        self.whole = 0
        self._fail = fail_range
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and "/blobs/" in request.url.path:
            with self._lock:
                if "Range" in request.headers:
                    self.ranges.append(request.headers["Range"])
                    if len(self.ranges) == self._fail:
                        raise httpx.ConnectError("injected: connection dropped", request=request)
                else:
                    self.whole += 1
        return super().handle_request(request)


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_module, "RANGE_BYTES", PIECE)


def stored(board, size: int, seed: int = 1) -> tuple[bytes, BlobSize]:
    data = os.urandom(size) if seed == 0 else bytes((i * seed + i // 7) % 251 for i in range(size))
    client = board.client(board.publish_token)
    client.create_run("r")
    sha = client.upload_blob("r", data)
    return data, BlobSize(sha256=sha, size=len(data))


def fetcher(board, cache: BlobCache, transport: httpx.HTTPTransport) -> Fetcher:
    # retries=0: a dropped range is seen by the fetcher, not hidden by the client's own retry
    return Fetcher(board.client(board.read_token, retries=0, transport=transport), "r", cache, backoff_s=0)


def test_a_large_blob_arrives_by_ranges_hashed_and_counted_once(board, tmp_path, small_pieces):
    data, blob = stored(board, 37 * PIECE + 123)
    cache = BlobCache(tmp_path)
    transport, counted = Recording(), list[int]()
    fetcher(board, cache, transport).fetch([blob], progress=counted.append)
    assert cache.path(blob.sha256).read_bytes() == data
    # every range once (an injected transport reads through httpx, not the plain sockets)
    assert sorted(transport.ranges) == sorted(
        f"bytes={a}-{min(blob.size, a + PIECE) - 1}" for a in range(0, blob.size, PIECE)
    )
    assert transport.whole == 0
    assert sum(counted) == blob.size
    assert sorted(p.name for p in tmp_path.iterdir()) == [blob.sha256]


def test_a_blob_by_ranges_through_plain_sockets_is_exact(board, tmp_path, small_pieces):
    data, blob = stored(board, 64 * PIECE + 1, seed=0)
    cache = BlobCache(tmp_path)
    client = board.client(board.read_token)
    assert client.plain_http() is not None
    Fetcher(client, "r", cache).fetch([blob])
    assert (
        hashlib.sha256(cache.path(blob.sha256).read_bytes()).hexdigest()
        == blob.sha256
        == hashlib.sha256(data).hexdigest()
    )


def test_a_range_that_fails_falls_back_to_one_stream_counting_no_byte_twice(board, tmp_path, small_pieces):
    data, blob = stored(board, 20 * PIECE)
    cache = BlobCache(tmp_path)
    transport, counted = Recording(fail_range=3), list[int]()
    fetcher(board, cache, transport).fetch([blob], progress=counted.append)
    assert cache.path(blob.sha256).read_bytes() == data
    assert transport.whole == 1
    assert sum(counted) == blob.size
    assert not cache.ranged(blob.sha256).exists()


def test_a_blob_corrupted_in_the_store_fails_after_ranges_and_one_stream(board, tmp_path, small_pieces):
    _, blob = stored(board, 10 * PIECE)
    for path in board.data_dir.rglob(blob.sha256):
        path.write_bytes(b"x" * blob.size)  # same size: the ranges arrive, the hash is wrong
    cache = BlobCache(tmp_path)
    transport = Recording()
    with pytest.raises(IntegrityError, match="hashed wrong twice"):
        fetcher(board, cache, transport).fetch([blob])
    assert transport.ranges and transport.whole == 1
    assert list(tmp_path.iterdir()) == []


def test_a_leftover_of_a_killed_ranged_fetch_is_never_taken_for_data(board, tmp_path, small_pieces):
    data, blob = stored(board, 12 * PIECE)
    cache = BlobCache(tmp_path)
    cache.ranged(blob.sha256).write_bytes(b"\0" * blob.size)  # holes a killed process left
    cache.ranged("f" * 64).write_bytes(b"stale")
    fetcher(board, cache, Recording()).fetch([blob])
    assert cache.path(blob.sha256).read_bytes() == data
    cache.keep_only({blob.sha256})
    assert sorted(p.name for p in tmp_path.iterdir()) == [blob.sha256]


def test_a_half_streamed_blob_resumes_as_a_stream(board, tmp_path, small_pieces):
    data, blob = stored(board, 16 * PIECE)
    cache = BlobCache(tmp_path)
    cache.streamed(blob.sha256).write_bytes(data[: 5 * PIECE])
    transport = Recording()
    fetcher(board, cache, transport).fetch([blob])
    assert cache.path(blob.sha256).read_bytes() == data
    assert transport.ranges == [f"bytes={5 * PIECE}-"]
