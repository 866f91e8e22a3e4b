"""The follower against a real board process and the real publisher."""

from __future__ import annotations

import json
import os
import subprocess
import threading

import httpx
import numpy as np
import pytest

from deltaboard.board.contract.errors import Unauthorized, UnknownRun
from deltaboard.board.contract.schemas import RetentionPolicy
from deltaboard.clients.follower import CorruptBase, DirectoryError, Follower, FollowerError, IntegrityError
from deltaboard.clients.follower.journal import Journal, SlotName, SlotRecord
from deltaboard.clients.follower.patcher import read_placements
from deltaboard.clients.follower.slots import Slots, other
from deltaboard.clients.follower.verify import served, verify_directory
from deltaboard.services.compact.build import SpanBuilder
from deltaboard.services.compact.worker import compact_head
from tests.clients.support import assert_view, publish_states, read_dir
from tests.support.servers import VENV_BIN

SIZES = {
    "embed.weight": (256, 64),
    "layers.0.weight": (64, 64),
    "layers.0.bias": (64,),
    "head.weight": (256, 64),
}


def test_bootstrap_catch_up_and_back_bit_exact_with_heartbeat(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "r", SIZES, 6, keyframe_every=4)
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "r", d, node_id="n1", engine="test") as f:
        assert f.version is None
        assert f.sync(2) == 2
        assert f.version == 2
        assert_view(d, views[2])
        assert json.loads((d / "config.json").read_text())["model_type"] == "test"
        assert f.sync() == 5  # a delta, a keyframe and a delta: starts from the keyframe
        assert_view(d, views[5])
        assert f.sync(1) == 1  # back in time: a keyframe chain
        assert_view(d, views[1])
        assert f.model_dir == d
    fleet = board.client(board.read_token).fleet("r")
    assert [(n.node_id, n.version, n.engine) for n in fleet] == [("n1", 1, "test")]
    assert os.path.islink(d / "current")
    # Both slots end at the served version (the stale one is mirrored), and the cache is empty.
    state = Journal(d / ".deltaboard" / "journal.json").read()
    assert state is not None and {r.version for r in state.slots.values()} == {1}
    assert not any((d / ".deltaboard" / "cache" / "blobs").iterdir())


def test_steady_updates_mirror_without_copy_and_sharded_layout(board, tmp_path):
    from deltaboard.board.contract.schemas import ViewSpec

    spec = ViewSpec(shard_max_bytes=40_000)
    views = publish_states(board.client(board.publish_token), "s", SIZES, 5, spec=spec)
    d = tmp_path / "model"
    phases: list[str] = []

    class Record:
        def start(self, phase: str, total: int) -> None:
            phases.append(phase)

        def advance(self, phase: str, n: int) -> None:
            pass

    with Follower(board.client(board.read_token), "s", d, node_id="n", progress=Record(), durable=True) as f:
        f.sync(1)
        phases.clear()
        for v in (2, 3, 4):
            f.sync(v)
            assert_view(d, views[v])
    assert "copy" not in phases and phases.count("mirror") == 3
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert verify_directory(d).ok


def test_commit_hook_controls_the_swap(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "h", SIZES, 3)
    d = tmp_path / "model"
    seen = []

    def hook(version, swap):
        before = read_dir(d) if version else None
        swap()
        seen.append(
            (
                version,
                before is not None
                and np.array_equal(before["head.weight"], views[version - 1]["head.weight"]),
            )
        )

    with Follower(board.client(board.read_token), "h", d, node_id="n", commit_hook=hook) as f:
        f.sync(0)
        f.sync(1)
    assert seen == [(0, False), (1, True)]  # until swap(), the old version is what is served

    def refuse(version, swap):
        raise RuntimeError("engine not ready")

    with Follower(board.client(board.read_token), "h", d, node_id="n", commit_hook=refuse) as f:
        with pytest.raises(RuntimeError):
            f.sync(2)
        assert f.version == 1
        assert_view(d, views[1])
    lazy = Follower(board.client(board.read_token), "h", d, node_id="n", commit_hook=lambda v, swap: None)
    with lazy, pytest.raises(FollowerError, match="without calling swap"):
        lazy.sync(2)
    with Follower(board.client(board.read_token), "h", d, node_id="n") as f:
        assert f.sync(2) == 2  # staged by the refused attempts: committed as is
        assert_view(d, views[2])


def test_follow_tracks_head_until_stopped(board, tmp_path):
    from deltaboard.publisher.publisher import Publisher
    from tests.clients.support import CONFIG, states, view_of

    d = tmp_path / "model"
    got: list[int] = []
    done = threading.Event()
    stop = threading.Event()

    def seen(version):
        got.append(version)
        if version == 3:
            done.set()

    follower = Follower(board.client(board.read_token), "f", d, node_id="fw", on_version=seen, poll_s=1.0)
    thread = threading.Thread(target=follower.follow, args=(stop,), kwargs={"run_wait_s": 30})
    thread.start()
    views = []
    with Publisher(
        board.client(board.publish_token), "f", assets={"config.json": json.dumps(CONFIG).encode()}
    ) as pub:
        for state in states(SIZES, 4):
            views.append(view_of(state))
            pub.publish(state).result()
    assert done.wait(30)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert got == sorted(got) and got[-1] == 3
    assert_view(d, views[3])
    assert [n.version for n in board.client(board.read_token).fleet("f")] == [3]
    follower.close()


def test_corrupt_cached_blob_is_refetched_once(board, tmp_path, monkeypatch):
    views = publish_states(board.client(board.publish_token), "c", SIZES, 3)
    d = tmp_path / "model"
    client = board.client(board.read_token)
    with Follower(client, "c", d, node_id="n") as f:
        f.sync(1)
        # Bit rot in the local cache after download: the codec's checksum catches it.
        real = f._fetcher.fetch
        rotted: list[str] = []

        def rot(blobs, progress=None):
            real(blobs, progress)
            for path in (d / ".deltaboard" / "cache" / "blobs").iterdir():
                if not rotted:
                    rotted.append(path.name)
                    data = bytearray(path.read_bytes())
                    data[-1] ^= 0xFF
                    path.write_bytes(bytes(data))

        monkeypatch.setattr(f._fetcher, "fetch", rot)
        assert f.sync(2) == 2
        assert rotted
        assert_view(d, views[2])


def test_a_span_is_read_by_ranges_unless_fetched_ahead(board, tmp_path, monkeypatch):
    """A node catching up by a span reads its patches by ranges as it decodes them: the
    span's blob is never downloaded whole into the cache. A span fetched ahead (`fetch`)
    is in the cache, and the sync applies it from there. Both bit-exact."""
    publisher = board.client(board.publish_token)
    views = publish_states(publisher, "s", SIZES, 6, keyframe_every=100)
    with (
        Follower(publisher, "s", tmp_path / "compact", node_id="compact") as worker,
        SpanBuilder(publisher, "s", worker) as builder,
    ):
        compact_head(builder, 5)
    reader = board.client(board.read_token)
    plan = reader.plan("s", 1, 5)
    assert [s.kind for s in plan.steps] == ["span"]
    span_blobs = {b.sha256 for b in plan.steps[0].blobs}
    downloaded: list[str] = []
    download = reader.download_blob

    def recorded(run, sha, path, progress=None):
        downloaded.append(sha)
        return download(run, sha, path, progress=progress)

    monkeypatch.setattr(reader, "download_blob", recorded)
    for name in ("ranged", "ahead"):
        d = tmp_path / name
        with Follower(reader, "s", d, node_id=name) as node:
            node.sync(1)
            downloaded.clear()
            if name == "ahead":
                node.fetch(5)
                assert all((d / ".deltaboard" / "cache" / "blobs" / sha).exists() for sha in span_blobs)
            assert node.sync(5) == 5
            assert_view(d, views[5])
        assert (set(downloaded) & span_blobs) == (span_blobs if name == "ahead" else set())


def test_bad_version_fails_loudly_and_leaves_the_served_one(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "b", SIZES, 2)
    admin = board.client()
    lease = admin.acquire_lease("b", "forger")
    v1 = admin.manifest("b", 1)
    # Version 2 re-uses version 1's patches, which were made against version 0: wrong base.
    admin.commit("b", v1.model_copy(update={"version": 2, "parent": 1, "epoch": lease.epoch}))
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "b", d, node_id="n") as f:
        f.sync(1)
        with pytest.raises(IntegrityError, match="again after a refetch"):
            f.sync(2)
        assert f.version == 1
    assert_view(d, views[1])


def test_blob_corrupted_on_the_board_fails_after_one_refetch(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "x", SIZES, 2)
    shas = board.client().manifest("x", 1).blob_shas()
    for path in board.data_dir.rglob("*"):
        if path.is_file() and path.name in shas:
            path.write_bytes(b"not what was published")
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "x", d, node_id="n") as f:
        f.sync(0)
        with pytest.raises(IntegrityError, match="hashed wrong twice"):
            f.sync(1)
        assert f.version == 0
    assert_view(d, views[0])


def test_dirty_slot_after_a_crash_is_rebuilt(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "d", SIZES, 3)
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "d", d, node_id="n") as f:
        f.sync(1)
    # A crash in the middle of writing the staging slot: garbage written, journal says dirty.
    stale: SlotName = "A" if served(d).slot_dir.name == "B" else "B"
    for shard in (d / ".deltaboard" / "slots" / stale).glob("*.safetensors"):
        shard.write_bytes(b"\0" * shard.stat().st_size)
    journal = Journal(d / ".deltaboard" / "journal.json")
    state = journal.read()
    assert state is not None
    journal.save(state.with_slot(stale, SlotRecord(state="dirty")))
    (d / "config.json").unlink()  # killed between the swap and the links' refresh
    with Follower(board.client(board.read_token), "d", d, node_id="n") as f:
        assert (d / "config.json").is_symlink()
        assert f.sync(2) == 2
    assert_view(d, views[2])


def test_pruned_base_bootstraps_from_a_keyframe(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "p", SIZES, 6, keyframe_every=4)
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "p", d, node_id="n") as f:
        f.sync(1)
        report = board.client().retention("p", RetentionPolicy(keep_last=2, grace_s=0))
        assert 1 in report.deleted_manifests
        assert f.sync() == 5
    assert_view(d, views[5])


def test_verify_detects_bit_rot_and_directories_are_guarded(board, tmp_path):
    publish_states(board.client(board.publish_token), "v", SIZES, 2)
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "v", d, node_id="n") as f:
        f.sync(1)
        with pytest.raises(DirectoryError, match="another follower"):
            Follower(board.client(board.read_token), "v", d, node_id="m")
    with pytest.raises(DirectoryError, match="follows run"):
        Follower(board.client(board.read_token), "other", d, node_id="m")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DirectoryError, match="not empty"):
        Follower(board.client(board.read_token), "v", foreign, node_id="m")

    env = {"DELTABOARD_URL": board.url, "DELTABOARD_TOKEN": board.read_token, "PATH": str(VENV_BIN)}
    ok = subprocess.run([str(VENV_BIN / "deltaboard"), "verify", str(d)], env=env, capture_output=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert b"board's manifest" in ok.stdout
    shard = served(d).slot_dir / "model.safetensors"
    with open(shard, "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 1]))
    report = verify_directory(d)
    assert not report.ok and report.bad_tensors and report.problems
    bad = subprocess.run([str(VENV_BIN / "deltaboard"), "verify", str(d)], env=env, capture_output=True)
    assert bad.returncode == 1
    assert b"does not hash" in bad.stdout


class FlakyBlobs(httpx.HTTPTransport):
    """A real transport whose first `fail` blob downloads die: a dropped connection, then 503s."""

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail = fail
        self.failed = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and "/blobs/" in request.url.path and self.failed < self.fail:
            self.failed += 1
            if self.failed == 1:
                raise httpx.ConnectError("injected: connection dropped", request=request)
            return httpx.Response(503, json={"error": {"code": "Unavailable", "message": "injected"}})
        return super().handle_request(request)


def test_downloads_are_retried_with_backoff(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "t", SIZES, 2)
    flaky = FlakyBlobs(fail=3)
    # No retries inside the client: the follower's own retry loop must carry the downloads.
    client = board.client(board.read_token, retries=0, transport=flaky)
    with Follower(client, "t", tmp_path / "model", node_id="n", workers=1) as f:
        assert f.sync(1) == 1
    assert flaky.failed == 3
    assert_view(tmp_path / "model", views[1])


def changed_elements(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Indices of the bf16 elements whose bits differ between two views of a tensor."""
    return np.flatnonzero(before.view(np.uint16) != after.view(np.uint16))


def flip(slot_dir, name: str, element: int) -> None:
    """Bit rot: flip the low bit of one bf16 element of a tensor, in the slot's file."""
    placement = read_placements(slot_dir / "model.safetensors")[name]
    with open(slot_dir / "model.safetensors", "r+b") as fh:
        fh.seek(placement.offset + 2 * element)
        byte = fh.read(1)
        fh.seek(placement.offset + 2 * element)
        fh.write(bytes([byte[0] ^ 1]))


def slot_of(d, name: SlotName):
    return d / ".deltaboard" / "slots" / name


def served_slot(d) -> SlotName:
    name = Slots(d).current()
    assert name is not None
    return name


NAME = "layers.0.weight"


def test_a_damaged_served_slot_is_refused_before_it_spreads_and_repaired(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "cs", SIZES, 4)
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "cs", d, node_id="n") as f:
        f.sync(1)
        current = served_slot(d)
        flip(slot_of(d, current), NAME, int(changed_elements(views[1][NAME], views[2][NAME])[0]))
        with pytest.raises(CorruptBase, match=f"served slot {current} does not hold version 1") as err:
            f.sync(2)
        assert err.value.tensors == [NAME] and "--repair" in str(err.value)
        assert f.version == 1  # nothing committed
        assert f.repair() == {current: [NAME]}
        assert f.version == 1 and verify_directory(d).ok
        assert_view(d, views[1])  # rebuilt from the intact other slot
        assert f.repair() == {}
        assert f.sync(3) == 3
        assert_view(d, views[3])


def test_damage_no_update_reads_is_found_by_verify_and_repaired_from_the_board(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "cu", SIZES, 3)
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "cu", d, node_id="n") as f:
        f.sync(1)
        current = served_slot(d)
        unchanged = np.setdiff1d(np.arange(64 * 64), changed_elements(views[1][NAME], views[2][NAME]))
        # the served slot at a position the next delta leaves alone, the other slot everywhere
        flip(slot_of(d, current), NAME, int(unchanged[0]))
        for shard in slot_of(d, other(current)).glob("*.safetensors"):
            shard.write_bytes(b"\0" * shard.stat().st_size)
        report = verify_directory(d)
        assert not report.ok and report.bad_tensors == [NAME]
        damage = f.repair(2)  # both slots damaged: version 2 comes from a keyframe chain
        assert damage[current] == [NAME] and sorted(damage[other(current)]) == sorted(SIZES)
        assert f.version == 2 and verify_directory(d).ok
        assert_view(d, views[2])
        assert f.repair() == {}


def test_a_damaged_staging_slot_is_corrupt_base_not_a_bad_blob(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "cg", SIZES, 3)
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "cg", d, node_id="n") as f:
        f.sync(1)
        staging = other(served_slot(d))
        flip(slot_of(d, staging), NAME, int(changed_elements(views[1][NAME], views[2][NAME])[0]))
        with pytest.raises(CorruptBase, match=f"slots/{staging}: tensor '{NAME}' does not hash"):
            f.sync(2)
        assert f.version == 1
        assert f.repair() == {}  # the failed update left that slot dirty: it is copied back
        assert f.sync(2) == 2
        assert_view(d, views[2])


def test_follow_fails_fast_on_what_retrying_cannot_fix(board, tmp_path):
    publish_states(board.client(board.publish_token), "ff", SIZES, 1)
    stop = threading.Event()
    refused = Follower(board.client("not-a-token"), "ff", tmp_path / "a", node_id="n", poll_s=0.2)
    with refused, pytest.raises(Unauthorized):
        refused.follow(stop)
    with Follower(board.client(board.read_token), "nope", tmp_path / "b", node_id="n", poll_s=0.2) as f:
        with pytest.raises(UnknownRun):
            f.follow(stop)  # no wait asked for: a misspelt run fails at once
        waited = threading.Thread(target=f.follow, args=(stop,), kwargs={"run_wait_s": 60})
        waited.start()
        waited.join(1.0)
        assert waited.is_alive()  # waiting for the run to appear
        stop.set()
        waited.join(10)
        assert not waited.is_alive()


def test_pull_refuses_a_damaged_directory_and_repair_brings_it_back(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "cr", SIZES, 3)
    d = tmp_path / "model"
    env = {"DELTABOARD_URL": board.url, "DELTABOARD_TOKEN": board.read_token, "PATH": str(VENV_BIN)}

    def deltaboard(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(VENV_BIN / "deltaboard"), *args], env=env, capture_output=True, text=True)

    pull = ("pull", "--run", "cr", "--dir", str(d))
    assert deltaboard(*pull, "--version", "1").returncode == 0
    flip(slot_of(d, served_slot(d)), NAME, int(changed_elements(views[1][NAME], views[2][NAME])[0]))
    refused = deltaboard(*pull, "--version", "2")
    lines = refused.stderr.splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and "Traceback" not in refused.stdout, refused
    assert lines[0].startswith("error: the served slot") and "deltaboard pull --repair" in lines[0]
    repaired = deltaboard(*pull, "--version", "2", "--repair")
    assert repaired.returncode == 0 and f"{NAME} did not hash" in repaired.stdout, repaired
    assert_view(d, views[2])

    unchanged = np.setdiff1d(np.arange(64 * 64), changed_elements(views[2][NAME], views[1][NAME]))
    flip(slot_of(d, served_slot(d)), NAME, int(unchanged[-1]))
    found = deltaboard("verify", "--dir", str(d))
    assert found.returncode == 1 and f"tensor {NAME} does not hash" in found.stdout
    assert "verify --repair" in found.stdout
    fixed = deltaboard("verify", "--dir", str(d), "--repair")
    assert fixed.returncode == 0 and "repaired slot" in fixed.stdout and "ok: " in fixed.stdout, fixed
    assert_view(d, views[2])
    with Follower(board.client(board.read_token), "cr", d, node_id="n") as f:
        assert f.repair() == {}  # both slots intact
