"""BoardClient behaviour under injected faults, against a real board: retries with
backoff on connection errors and 5xx, resumable downloads, idempotent commit retries."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import pytest

from deltaboard.board.contract.errors import BoardUnavailable, NotHead
from deltaboard.clients.board_client import BlobIntegrityError, BoardClient
from tests.support.manifests import manifest, publish


class Faults(httpx.BaseTransport):
    """Wraps the real transport; scripted failures for requests whose path contains `match`."""

    def __init__(
        self,
        match: str,
        *,
        refuse: int = 0,
        status: int = 0,
        cut_after: int | None = None,
        lose_response: int = 0,
    ) -> None:
        self.inner = httpx.HTTPTransport()
        self.match, self.refuse, self.status, self.cut_after, self.lose_response = (
            match,
            refuse,
            status,
            cut_after,
            lose_response,
        )
        self.seen = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.match not in request.url.path:
            return self.inner.handle_request(request)
        self.seen += 1
        if self.refuse:
            self.refuse -= 1
            raise httpx.ConnectError("injected: connection refused", request=request)
        if self.status:
            self.status -= 1
            return httpx.Response(503, json={"error": {"code": "Unavailable", "message": "injected"}})
        response = self.inner.handle_request(request)
        if self.lose_response:
            self.lose_response -= 1
            response.read()
            raise httpx.ReadError("injected: response lost", request=request)
        if self.cut_after is not None:
            limit, self.cut_after = self.cut_after, None
            return httpx.Response(
                response.status_code,
                headers=response.headers,
                stream=Truncated(response, limit),
                request=request,
            )
        return response


class Truncated(httpx.SyncByteStream):
    def __init__(self, response: httpx.Response, limit: int) -> None:
        self.response, self.limit = response, limit

    def __iter__(self) -> Iterator[bytes]:
        sent = 0
        for chunk in self.response.iter_raw():
            if sent + len(chunk) > self.limit:
                yield chunk[: self.limit - sent]
                raise httpx.ReadError("injected: connection cut mid-body")
            sent += len(chunk)
            yield chunk

    def close(self) -> None:
        self.response.close()


def faulty(board, faults: Faults, token: str | None = None) -> BoardClient:
    return BoardClient(board.url, token or board.admin_token, transport=faults, backoff_s=0.01)


def test_retries_connection_errors_and_5xx(board):
    board.client().create_run("r")
    faults = Faults("/v1/runs/r", refuse=2, status=2)
    with faulty(board, faults) as c:
        assert c.get_run("r").name == "r"
    assert faults.seen == 5
    with faulty(board, Faults("/v1/runs/r", status=10)) as c, pytest.raises(BoardUnavailable) as e:
        c.get_run("r")
    assert e.value.http_status == 503


def test_download_resumes_after_a_cut(board, tmp_path):
    c = board.client()
    c.create_run("r")
    data = hashlib.sha256(b"seed").digest() * 100_000
    sha = c.upload_blob("r", data)
    faults = Faults("/blobs/", cut_after=1_000_000)
    progress: list[int] = []
    with faulty(board, faults) as fc:
        dest = fc.download_blob("r", sha, tmp_path / "blob", progress=progress.append)
    assert dest.read_bytes() == data and sum(progress) == len(data)
    assert faults.seen == 2  # the second request asked only for the rest (Range)
    assert not (tmp_path / "blob.part").exists()


def test_download_refuses_bytes_that_do_not_match(board, tmp_path):
    c = board.client()
    c.create_run("r")
    data = b"x" * 5000
    sha = c.upload_blob("r", data)
    (tmp_path / "blob.part").write_bytes(b"y" * 100)  # a corrupt leftover
    with pytest.raises(BlobIntegrityError) as e:
        c.download_blob("r", sha, tmp_path / "blob")
    assert e.value.sha256 == sha and e.value.got == hashlib.sha256(b"y" * 100 + data[100:]).hexdigest()
    assert not (tmp_path / "blob").exists() and not (tmp_path / "blob.part").exists()
    assert c.download_blob("r", sha, tmp_path / "blob").read_bytes() == data  # a clean retry works


def test_commit_whose_answer_was_lost_is_recognised(board):
    c = board.client()
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    publish(c, "r", 0, epoch, {"w": b"zero"})
    c.upload_blob("r", b"one")
    m = manifest("r", 1, epoch, {"w": b"one"})
    with faulty(board, Faults("/commit", lose_response=1)) as fc:
        head = fc.commit("r", m)  # retried; the board answers NotHead; the client checks
    assert head.version == 1
    other = manifest("r", 1, epoch, {"w": b"one"}, meta={"other": True})
    with pytest.raises(NotHead) as e:
        c.commit("r", other)
    assert (e.value.code, e.value.http_status, e.value.extra["head"]) == ("NotHead", 409, 1)


class Recording(httpx.HTTPTransport):
    """The real transport, noting each request's Content-Encoding and body size."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, str | None, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.url.path, request.headers.get("content-encoding"), len(request.read())))
        return super().handle_request(request)


def test_a_large_commit_goes_as_zstd_and_lands_as_sent(board):
    """A manifest of many tensors is committed as a zstd body (a fraction of its JSON),
    a small one as plain JSON; both read back as committed."""
    c = board.client()
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    c.upload_blob("r", b"w0")
    many = manifest("r", 0, epoch, {f"w{i:05d}": b"w0" for i in range(2000)})
    c.upload_blob("r", b"w1")
    one = manifest("r", 1, epoch, {"w00000": b"w1"})
    recording = Recording()
    with BoardClient(board.url, board.admin_token, transport=recording) as rc:
        rc.commit("r", many)
        rc.commit("r", one)
    assert (c.manifest("r", 0), c.manifest("r", 1)) == (many, one)
    (_, big_encoding, big_sent), (_, small_encoding, _) = [
        s for s in recording.sent if s[0].endswith("/commit")
    ]
    assert (big_encoding, small_encoding) == ("zstd", None)
    assert big_sent < len(many.model_dump_json()) / 5
