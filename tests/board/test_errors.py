"""The error vocabulary: every code has a class and a status; what the board sends, the
client rebuilds as the same class; a download that hashes wrong is its own error."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import httpx
import pytest

from deltaboard.board.contract.errors import (
    CLIENT_CODES,
    ERROR_CLASSES,
    AuthError,
    BoardError,
    BoardUnavailable,
    Conflict,
    ErrorCode,
    InvalidRequest,
    NotFound,
    NotHead,
    StoreUnavailable,
    Unauthorized,
    UnknownRun,
    error_class,
)
from deltaboard.board.server.api.errors import FRAMEWORK_CODES, HTTP_STATUS, error_response, status_of
from deltaboard.clients.board_client import BlobIntegrityError, BoardClient, error_from
from deltaboard.clients.follower.errors import IntegrityError
from deltaboard.clients.follower.fetch import BlobCache, Fetcher
from tests.support.manifests import manifest, publish

FAMILY_STATUSES: dict[type[BoardError], set[int]] = {
    InvalidRequest: {400, 405, 411, 413, 415, 416, 422},
    AuthError: {401, 403},
    NotFound: {404},
    Conflict: {409},
    BoardUnavailable: {500, 503},
}


def test_every_code_has_a_class_and_a_status():
    assert set(ERROR_CLASSES) == set(ErrorCode)
    # The client assigns HTTPError (a status the framework chose) and InvalidResponse (an
    # answer that breaks its schema); every other code is the board's, with its own status.
    assert set(HTTP_STATUS) == set(ErrorCode) - CLIENT_CODES
    assert ERROR_CLASSES[ErrorCode.HTTP_ERROR] is BoardError  # deliberately plain
    for code, cls in ERROR_CLASSES.items():
        if code in CLIENT_CODES:
            continue
        family = next(f for f in FAMILY_STATUSES if issubclass(cls, f))
        assert HTTP_STATUS[code] in FAMILY_STATUSES[family], code
        if cls.default_code is not None and cls.default_code == code:
            assert cls("m").code == code  # a class knows its own code
    for status, code in FRAMEWORK_CODES.items():
        assert HTTP_STATUS[code] == status


@pytest.mark.parametrize("code", sorted(set(ErrorCode) - CLIENT_CODES))
def test_the_client_rebuilds_what_the_server_sends(code):
    sent = error_class(code)("it failed", code=code, head=3, missing=["a"])
    answer = error_response(sent)
    assert answer.status_code == status_of(sent) == HTTP_STATUS[code]
    assert (answer.headers.get("www-authenticate") == "Bearer") == (code == ErrorCode.UNAUTHORIZED)
    assert ("retry-after" in answer.headers) == (answer.status_code == 503)
    detail = json.loads(bytes(answer.body))["error"]
    extra = {k: v for k, v in detail.items() if k not in ("code", "message")}
    rebuilt = error_from(answer.status_code, detail["code"], detail["message"], **extra)
    assert type(rebuilt) is type(sent)
    assert (
        rebuilt.body()
        == sent.body()
        == {"error": {"code": code, "message": "it failed", "head": 3, "missing": ["a"]}}
    )
    assert rebuilt.http_status == answer.status_code and sent.http_status is None


def test_unknown_codes_stay_plain_and_5xx_is_unavailable():
    plain = error_from(418, "Teapot", "short and stout", spout=True)
    assert type(plain) is BoardError and (plain.code, plain.extra) == ("Teapot", {"spout": True})
    assert str(plain) == "418 Teapot: short and stout"
    for code in ("NotHead", "Internal", "HTTPError", "Whatever"):
        assert type(error_from(503, code, "busy")) is BoardUnavailable
    assert type(error_from(503, "StoreUnavailable", "down")) is StoreUnavailable
    assert error_class("NoSuchCode") is BoardError
    # Without the board's body (a HEAD, a proxy's page) the status alone classes a few.
    assert type(error_from(404, "HTTPError", "Not Found")) is NotFound
    assert type(error_from(401, "HTTPError", "Unauthorized")) is Unauthorized
    assert type(error_from(409, "HTTPError", "Conflict")) is BoardError
    with pytest.raises(TypeError):
        BoardError("a plain BoardError needs a code")


def test_errors_survive_pickling():
    sent = NotHead("moved", head=4, http_status=409)
    back = pickle.loads(pickle.dumps(sent))
    assert type(back) is NotHead and (back.message, back.extra, back.http_status) == (
        "moved",
        {"head": 4},
        409,
    )
    assert str(back) == str(sent) == "409 NotHead: moved"


def test_a_real_board_answers_with_classes_the_client_rebuilds(board):
    c = board.client(board.publish_token)
    with pytest.raises(UnknownRun) as unknown:
        c.get_run("r")
    assert unknown.value.http_status == 404
    c.create_run("r")
    epoch = c.acquire_lease("r", "trainer").epoch
    publish(c, "r", 0, epoch, {"w": b"zero"})
    c.upload_blob("r", b"one")
    with pytest.raises(NotHead) as conflict:  # version 0 again
        c.commit("r", manifest("r", 0, epoch, {"w": b"one"}))
    assert (conflict.value.code, conflict.value.http_status, conflict.value.extra["head"]) == (
        "NotHead",
        409,
        0,
    )
    with BoardClient(board.url) as anonymous, pytest.raises(Unauthorized) as refused:
        anonymous.get_run("r")
    assert refused.value.http_status == 401


def blob_server(data: bytes) -> httpx.MockTransport:
    """A board that serves `data` for any blob (so any other sha256 hashes wrong)."""
    return httpx.MockTransport(lambda request: httpx.Response(200, content=data))


def test_a_blob_that_hashes_wrong_is_an_integrity_error(tmp_path: Path):
    wanted = hashlib.sha256(b"right").hexdigest()
    with (
        BoardClient("http://board", transport=blob_server(b"wrong")) as c,
        pytest.raises(BlobIntegrityError) as e,
    ):
        c.download_blob("r", wanted, tmp_path / "blob")
    assert not isinstance(e.value, BoardError)
    assert (e.value.sha256, e.value.got) == (wanted, hashlib.sha256(b"wrong").hexdigest())
    assert not list(tmp_path.iterdir())  # nothing partial is left


def test_the_follower_refetches_once_then_calls_it_an_integrity_error(tmp_path: Path):
    wanted = hashlib.sha256(b"right").hexdigest()
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, content=b"wrong")

    with BoardClient("http://board", transport=httpx.MockTransport(handler)) as c:
        fetcher = Fetcher(c, "r", BlobCache(tmp_path), backoff_s=0.0)
        with pytest.raises(IntegrityError, match="hashed wrong twice"):
            fetcher.refetch(wanted)
    assert len(calls) == 2
