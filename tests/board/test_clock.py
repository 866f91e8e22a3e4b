"""Time-based behaviour of the board through the real FastAPI app, in this process, with a
manual clock: leases expire and fleet nodes drop out when the clock is moved, with no sleep."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from deltaboard.board.contract.errors import BoardError, LeaseHeld, StaleEpoch
from deltaboard.board.server.api.app import create_app
from deltaboard.board.server.clock import ManualClock
from deltaboard.board.server.settings import Settings
from deltaboard.clients.board_client import error_from

TOKEN = "publish-token-1"
FLEET_TTL_S = 300.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def http(tmp_path: Path, clock: ManualClock) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path / "board", tokens=f"publish:{TOKEN}", fsync=False, fleet_ttl_s=FLEET_TTL_S
    )
    with TestClient(create_app(settings, clock=clock)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        assert client.post("/v1/runs", json={"name": "r"}).status_code == 201
        yield client


def refusal(response) -> BoardError:  # the test client's response class varies with Starlette
    """The error the client would raise for this answer."""
    detail = response.json()["error"]
    extra = {k: v for k, v in detail.items() if k not in ("code", "message")}
    return error_from(response.status_code, detail["code"], detail["message"], **extra)


def test_a_lease_expires_when_the_clock_passes_its_ttl(http: TestClient, clock: ManualClock) -> None:
    first = http.post("/v1/runs/r/lease", json={"holder": "a", "ttl_s": 30})
    assert first.status_code == 201 and first.json()["expires_at"] == clock.now() + 30
    clock.advance(29)
    held = refusal(http.post("/v1/runs/r/lease", json={"holder": "b", "ttl_s": 30}))
    assert isinstance(held, LeaseHeld) and held.extra["holder"] == "a"
    clock.advance(2)
    second = http.post("/v1/runs/r/lease", json={"holder": "b", "ttl_s": 30})
    assert second.status_code == 201 and second.json()["epoch"] == first.json()["epoch"] + 1
    renew = {"holder": "a", "epoch": first.json()["epoch"], "ttl_s": 30}
    assert isinstance(refusal(http.post("/v1/runs/r/lease/renew", json=renew)), StaleEpoch)


def test_a_fleet_node_drops_out_after_fleet_ttl(http: TestClient, clock: ManualClock) -> None:
    assert http.post("/v1/runs/r/fleet", json={"node_id": "n1", "version": None}).status_code == 204
    nodes = http.get("/v1/runs/r/fleet").json()
    assert [(n["node_id"], n["last_seen"]) for n in nodes] == [("n1", clock.now())]
    clock.advance(FLEET_TTL_S / 2)
    assert http.post("/v1/runs/r/fleet", json={"node_id": "n2", "version": None}).status_code == 204
    clock.advance(FLEET_TTL_S / 2)  # n1 is exactly fleet_ttl_s old: gone
    assert [n["node_id"] for n in http.get("/v1/runs/r/fleet").json()] == ["n2"]
    clock.advance(FLEET_TTL_S / 2)
    assert http.get("/v1/runs/r/fleet").json() == []


def test_the_run_is_stamped_with_the_clock(http: TestClient, clock: ManualClock) -> None:
    assert http.get("/v1/runs/r").json()["created_at"] == clock.now()
    clock.advance(5)
    assert http.post("/v1/runs", json={"name": "s"}).json()["created_at"] == clock.now()


def test_the_manual_clock_only_moves_forward() -> None:
    clock = ManualClock(now=100.0)
    clock.advance(2.5)
    assert (clock.now(), clock.monotonic()) == (102.5, 2.5)
    with pytest.raises(ValueError):
        clock.advance(-1)
