"""A manifest prepared before its commit (`POST .../prepare`), then committed by name,
against a real board; the board's bounded hold of prepared manifests, alone."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from deltaboard.board.contract.errors import BadManifest, Forbidden, MissingBlobs, StaleEpoch, UnknownPrepared
from deltaboard.board.contract.schemas import Manifest
from deltaboard.board.server.clock import ManualClock
from deltaboard.board.server.prepared import PreparedManifest, PreparedManifests
from deltaboard.clients.board_client import BoardClient
from tests.board.test_client import Recording
from tests.support.manifests import manifest, publish


def counter(board, name: str) -> float:
    text = httpx.get(f"{board.url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_prepared_manifest_commits_by_name_as_the_manifest_itself_would(board):
    """The commit names the prepared manifest (a body of a few bytes, not the manifest), and
    the board stores and serves exactly the manifest that was prepared."""
    c = board.client()
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    payloads = {f"w{i:04d}": b"w0" for i in range(500)}
    c.upload_blob("r", b"w0")
    m = manifest("r", 0, epoch, payloads)
    recording = Recording()
    with BoardClient(board.url, board.admin_token, transport=recording) as rc:
        prepared = rc.prepare("r", m)
        assert (prepared.run, prepared.version, prepared.expires_in_s > 0) == ("r", 0, True)
        assert c.head("r").version is None  # prepared is not committed
        head = rc.commit("r", m, prepared=prepared.prepared)
    assert (head.version, head.epoch) == (0, epoch)
    assert c.manifest("r", 0) == m
    stored = httpx.get(
        f"{board.url}/v1/runs/r/manifests/0", headers={"Authorization": f"Bearer {board.admin_token}"}
    ).content
    assert prepared.prepared == hashlib.sha256(stored).hexdigest()
    commits = [size for path, _, size in recording.sent if path.endswith("/commit")]
    assert len(commits) == 1 and commits[0] < 200
    assert counter(board, "deltaboard_prepared_commits_total") == 1


def test_a_name_the_board_does_not_hold_is_refused_and_the_client_sends_the_manifest(board):
    c = board.client()
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    c.upload_blob("r", b"zero")
    m = manifest("r", 0, epoch, {"w": b"zero"})
    unknown = "ab" * 32
    answer = httpx.post(
        f"{board.url}/v1/runs/r/commit",
        json={"prepared": unknown},
        headers={"Authorization": f"Bearer {board.publish_token}"},
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "UnknownPrepared"
    assert c.head("r").version is None
    assert c.commit("r", m, prepared=unknown).version == 0  # the client fell back to the manifest
    assert c.manifest("r", 0) == m
    assert counter(board, "deltaboard_prepared_commits_total") == 0


def test_a_prepared_commit_still_checks_the_boards_state(board):
    """Blobs, fencing and succession are checked at the commit, not at the prepare: a
    refused commit by name leaves nothing committed, and the name stays usable."""
    c = board.client()
    c.create_run("r")
    epoch = c.acquire_lease("r", "t").epoch
    m = manifest("r", 0, epoch, {"w": b"zero"})
    name = c.prepare("r", m).prepared
    with pytest.raises(MissingBlobs):
        c.commit("r", m, prepared=name)
    assert c.head("r").version is None
    c.upload_blob("r", b"zero")
    assert c.commit("r", m, prepared=name).version == 0
    assert counter(board, "deltaboard_prepared_commits_total") == 1  # the refused one not counted
    stale = manifest("r", 1, epoch, {"w": b"zero"})
    stale_name = c.prepare("r", stale).prepared
    c.acquire_lease("r", "u", steal=True)  # fences the first writer's epoch off
    with pytest.raises(StaleEpoch):
        c.commit("r", stale, prepared=stale_name)
    assert c.head("r").version == 0


def test_prepare_refuses_what_a_commit_would_and_a_commit_takes_one_form(board):
    c = board.client()
    c.create_run("r")
    c.create_run("s")
    epoch = c.acquire_lease("r", "t").epoch
    with pytest.raises(Forbidden):
        board.client(board.read_token).prepare("r", manifest("r", 0, epoch, {"w": b"zero"}))
    with pytest.raises(BadManifest):
        c.prepare("r", manifest("s", 0, epoch, {"w": b"zero"}))  # another run's
    with pytest.raises(BadManifest):
        c.prepare("r", manifest("r", 0, epoch, {"w": b"zero"}, kind="delta"))  # version 0 a delta
    both = {"manifest": manifest("r", 0, epoch, {"w": b"x"}).model_dump(mode="json"), "prepared": "ab" * 32}
    for body in (both, {}):
        answer = httpx.post(
            f"{board.url}/v1/runs/r/commit",
            json=body,
            headers={"Authorization": f"Bearer {board.publish_token}"},
        )
        assert answer.status_code == 422 and answer.json()["error"]["code"] == "ValidationError"
    publish(c, "r", 0, epoch, {"w": b"zero"})  # the board is unharmed
    assert c.head("r").version == 0


def _prepared(run: str, version: int) -> PreparedManifest:
    m: Manifest = manifest(run, version, 1, {"w": bytes([version])})
    as_json = m.model_dump_json().encode()
    return PreparedManifest(m, as_json, b"packed")


def test_prepared_manifests_expire_and_the_least_recently_prepared_goes_first():
    clock = ManualClock()
    held = PreparedManifests(clock, ttl_s=10.0, entries=2)
    versions = [_prepared("r", v) for v in range(3)]
    first, second, third = (held.put(p) for p in versions)
    assert len(held) == 2
    with pytest.raises(UnknownPrepared):
        held.get("r", first)  # evicted by the third
    assert held.get("r", second).manifest.version == 1
    with pytest.raises(UnknownPrepared):
        held.get("other", second)  # another run's name is not this run's manifest
    clock.advance(9.0)
    assert held.put(versions[1]) == second  # prepared again: one entry, its time renewed
    clock.advance(9.0)
    assert held.get("r", second).manifest.version == 1
    with pytest.raises(UnknownPrepared):
        held.get("r", third)  # prepared 18 s ago
    held.discard(second)
    assert len(held) == 0


def test_prepared_manifests_hold_a_bounded_amount_of_json():
    versions = [_prepared("r", v) for v in range(3)]
    size = len(versions[0].as_json)
    held = PreparedManifests(ManualClock(), entries=8, json_bytes=2 * size + size // 2)
    names = [held.put(p) for p in versions]
    assert len(held) == 2
    with pytest.raises(UnknownPrepared):
        held.get("r", names[0])  # the oldest went for the third's bytes
    assert [held.get("r", n).manifest.version for n in names[1:]] == [1, 2]
    alone = PreparedManifests(ManualClock(), json_bytes=size - 1)
    name = alone.put(versions[0])  # larger than the whole hold: not kept
    assert len(alone) == 0
    with pytest.raises(UnknownPrepared):
        alone.get("r", name)
