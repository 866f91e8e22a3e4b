"""The long-poll's fast path (`board.server.api.longpoll`) answers what the `/head` route
answers, and leaves to the route every request it does not recognise as well-formed."""

from __future__ import annotations

import threading

import httpx
import pytest

from deltaboard.board.server.api.longpoll import poll_of
from tests.support.manifests import publish


def scope(path: str, query: str = "", method: str = "GET") -> dict[str, object]:
    return {"type": "http", "method": method, "path": path, "query_string": query.encode()}


@pytest.mark.parametrize(
    ("path", "query", "want"),
    [
        ("/v1/runs/r/head", "", ("r", None, 0.0)),
        ("/v1/runs/r-1.x/head", "after=-1&wait=2.5", ("r-1.x", -1, 2.5)),
        ("/v1/runs/r/head", "wait=60", ("r", None, 60.0)),
    ],
)
def test_well_formed_polls_are_recognised(path, query, want):
    assert poll_of(scope(path, query)) == want


@pytest.mark.parametrize(
    ("path", "query", "method"),
    [
        ("/v1/runs/r/head", "after=x", "GET"),
        ("/v1/runs/r/head", "after=-2", "GET"),
        ("/v1/runs/r/head", "after=1&after=2", "GET"),
        ("/v1/runs/r/head", "wait=61", "GET"),
        ("/v1/runs/r/head", "wait=nan", "GET"),
        ("/v1/runs/r/head", "wait=1e1", "GET"),
        ("/v1/runs/r/head", "other=1", "GET"),
        ("/v1/runs/.r/head", "", "GET"),
        ("/v1/runs/r/head", "", "POST"),
        ("/v1/runs/r/heads", "", "GET"),
        # Other spellings of a well-formed poll: the route decodes and judges them.
        ("/v1/runs/r/head", "after=%31", "GET"),
        ("/v1/runs/r/head", "after=1&", "GET"),
        ("/v1/runs/r/head", "&wait=1", "GET"),
        ("/v1/runs/r/head", "wait=+1", "GET"),
    ],
)
def test_anything_else_goes_to_the_route(path, query, method):
    assert poll_of(scope(path, query, method)) is None


def test_fast_path_and_route_answer_alike(board):
    c = board.client(board.publish_token)
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    publish(c, "r", 0, epoch, {"w": b"zero"})
    read = {"Authorization": f"Bearer {board.read_token}"}
    url = f"{board.url}/v1/runs"
    fast = httpx.get(f"{url}/r/head", params={"after": -1, "wait": 1}, headers=read)
    assert fast.status_code == 200 and fast.json()["version"] == 0
    encoded = httpx.get(f"{url}/r/head?after=%2D1&wait=1&", headers=read)  # the route's
    assert encoded.status_code == 200 and encoded.json() == fast.json()
    missing = httpx.get(f"{url}/nope/head", params={"wait": 1}, headers=read)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "UnknownRun"
    refused = httpx.get(f"{url}/r/head", headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    bad = httpx.get(f"{url}/r/head", params={"after": "x"}, headers=read)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "ValidationError"
    got: dict[str, httpx.Response] = {}
    poller = threading.Thread(
        target=lambda: got.update(r=httpx.get(f"{url}/r/head?after=0&wait=30", headers=read, timeout=40))
    )
    poller.start()
    publish(c, "r", 1, epoch, {"w": b"one"})
    poller.join(35)
    assert got["r"].status_code == 200 and got["r"].json()["version"] == 1
    assert 'deltaboard_requests_total{route="/v1/runs/{run}/head",status="200"}' in c.metrics()
