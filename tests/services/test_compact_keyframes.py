"""Worker keyframes against a real board: built from the worker's copy at head, checked by
the board against the committed manifests, planned for new nodes, fetched by parallel
ranged requests each checked by its patch's checksum, and kept by retention only while a plan
takes them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from deltaboard.board.contract.errors import BadManifest, Forbidden, MissingBlobs, UnknownVersion
from deltaboard.board.contract.schemas import RetentionPolicy, TensorPart
from deltaboard.board.contract.spans import KeyframeManifest
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower import Follower, IntegrityError
from deltaboard.services.compact.build import SpanBuilder
from deltaboard.services.compact.keyframes import build_keyframe
from deltaboard.services.compact.worker import compact_head
from tests.clients.support import assert_view, publish_states
from tests.support.servers import VENV_BIN

SIZES = {"embed.weight": (128, 32), "layers.0.weight": (32, 32), "layers.0.bias": (32,)}


class RangeCountingClient(BoardClient):
    """Records every blob read it makes through httpx: (sha, start, end); whole downloads as
    (sha, None, None). With `plain`, a follower reads a keyframe's ranges on plain
    connections of its own (`clients.follower.ranges`), which are not recorded."""

    def __init__(self, url: str, token: str, *, plain: bool = False) -> None:
        super().__init__(url, token)
        self.reads: list[tuple[str, int | None, int | None]] = []
        self.plain = plain

    def plain_http(self) -> tuple[str, dict[str, str], float] | None:
        return super().plain_http() if self.plain else None

    def get_blob(self, run: str, sha256: str, start: int | None = None, end: int | None = None) -> bytes:
        self.reads.append((sha256, start, end))
        return super().get_blob(run, sha256, start, end)

    def download_blob(self, run: str, sha256: str, dest: Path, **kwargs: object) -> Path:
        self.reads.append((sha256, None, None))
        return super().download_blob(run, sha256, dest, **kwargs)  # type: ignore[arg-type]


def keyframe_at(board, tmp: Path, head: int) -> tuple[KeyframeManifest, bytes]:
    client = board.client(board.compact_token)
    with (
        Follower(client, "r", tmp / f"worker-{head}", node_id="w") as follower,
        SpanBuilder(client, "r", follower) as builder,
    ):
        builder.build(head)
        return build_keyframe(builder, head)


@pytest.fixture
def run(board, tmp_path):
    """Ten versions after one trainer keyframe, and a worker keyframe of version 9."""
    views = publish_states(board.client(board.publish_token), "r", SIZES, 10, keyframe_every=100)
    return views, keyframe_at(board, tmp_path, 9)


@pytest.mark.parametrize("plain", [False, True])
def test_a_new_node_starts_at_the_worker_keyframe_fetched_by_ranges(run, board, tmp_path, plain):
    """Each range read once, through httpx or (`plain`) on the follower's own connections."""
    views, (keyframe, blob) = run
    compactor = board.client(board.compact_token)
    reader = board.client(board.read_token)
    before = reader.plan("r", None, 9)
    compactor.upload_blob("r", blob)
    registered = compactor.register_keyframe("r", keyframe)
    assert registered.created and registered.manifest_url == "/v1/runs/r/keyframes/9"
    assert compactor.register_keyframe("r", keyframe).created is False
    plan = reader.plan("r", None, 9)
    assert [(s.kind, s.version) for s in plan.steps] == [("keyframe", 9)]
    assert plan.total_bytes < before.total_bytes
    counting = RangeCountingClient(board.url, board.read_token, plain=plain)
    with counting, Follower(counting, "r", tmp_path / "node", node_id="n1") as node:
        assert node.sync(9) == 9
        assert_view(tmp_path / "node", views[9])
    ranges = sorted((t.blob.sha256, t.blob.offset, t.blob.offset + t.blob.length) for t in keyframe.tensors)
    assert sorted(r for r in counting.reads if r[0] in keyframe.blob_shas()) == ([] if plain else ranges)


def test_a_node_past_it_takes_the_keyframe_then_the_deltas(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "r", SIZES, 12, keyframe_every=100)
    keyframe, blob = keyframe_at(board, tmp_path, 9)
    compactor = board.client(board.compact_token)
    compactor.upload_blob("r", blob)
    compactor.register_keyframe("r", keyframe)
    plan = board.client(board.read_token).plan("r", None, 11)
    assert [(s.kind, s.version) for s in plan.steps] == [("keyframe", 9), ("delta", 10), ("delta", 11)]
    assert plan.strategy == "keyframe+deltas"
    with Follower(board.client(board.read_token), "r", tmp_path / "node", node_id="n1") as node:
        node.sync(11)
        assert_view(tmp_path / "node", views[11])


def test_wrong_keyframes_are_refused_and_nothing_is_stored(run, board):
    _, (keyframe, blob) = run
    compactor = board.client(board.compact_token)
    first, *rest = keyframe.tensors
    whole = TensorPart(offset=(0,) * len(first.shape), shape=first.shape, digest=first.digest)
    wrong = [
        keyframe.model_copy(update={"tensors": (first.model_copy(update={"digest": "0" * 32}), *rest)}),
        keyframe.model_copy(update={"tensors": tuple(rest)}),  # a tensor left out
        keyframe.model_copy(update={"tensors": (*rest, first)}),  # not the layout's order
        keyframe.model_copy(update={"tensors": (first.model_copy(update={"part": whole}), *rest)}),
        keyframe.model_copy(update={"tensors": (first.model_copy(update={"shape": (1,)}), *rest)}),
        keyframe.model_copy(update={"version": 8}),  # another version's state
    ]
    with pytest.raises(MissingBlobs):
        compactor.register_keyframe("r", keyframe)
    compactor.upload_blob("r", blob)
    for bad in wrong:
        with pytest.raises(BadManifest) as refused:
            compactor.register_keyframe("r", bad)
        assert refused.value.http_status == 422
    with pytest.raises(UnknownVersion):
        compactor.register_keyframe("r", keyframe.model_copy(update={"version": 10}))
    with pytest.raises(Forbidden):
        board.client(board.read_token).register_keyframe("r", keyframe)
    with pytest.raises(UnknownVersion):
        board.client(board.read_token).keyframe("r", 9)
    assert not (board.data_dir / "store" / "runs" / "r" / "keyframes").exists()


@pytest.mark.parametrize("plain", [False, True])
def test_a_range_that_fails_its_checksum_is_refetched_once_then_refused(run, board, tmp_path, plain):
    """A keyframe whose first range rotted in the store after the board took it: the new
    node fetches that range twice (the patch's checksum fails both times), then stops with
    `IntegrityError` and serves nothing; through httpx or on its own connections."""
    _, (keyframe, blob) = run
    compactor = board.client(board.compact_token)
    compactor.upload_blob("r", blob)
    compactor.register_keyframe("r", keyframe)
    ref = keyframe.tensors[0].blob
    (stored,) = (p for p in board.data_dir.rglob(ref.sha256) if p.is_file())
    rotted = bytearray(stored.read_bytes())
    rotted[ref.offset + ref.length // 2] ^= 0x10
    stored.write_bytes(bytes(rotted))
    counting = RangeCountingClient(board.url, board.read_token, plain=plain)
    with counting, Follower(counting, "r", tmp_path / "node", node_id="n1") as node:
        with pytest.raises(IntegrityError, match="checksum twice"):
            node.sync(9)
        assert node.version is None
    assert counting.reads.count((ref.sha256, ref.offset, ref.offset + ref.length)) == (0 if plain else 2)


def test_the_follower_proves_a_keyframe_by_its_digests_not_its_range_hashes(run, board, tmp_path):
    """A keyframe whose `range_sha256` are all wrong but whose bytes are intact is served
    (the ranges' sha256 would prove the bytes the checksum and the digests already prove);
    one whose range holds another tensor's valid patch is refused by the digests."""
    views, (keyframe, blob) = run
    store = board.data_dir / "store" / "runs" / "r" / "keyframes"
    store.mkdir(parents=True)
    wrong_hashes = keyframe.model_copy(
        update={"tensors": tuple(t.model_copy(update={"range_sha256": "0" * 64}) for t in keyframe.tensors)}
    )
    (store / "000000000009.json").write_text(wrong_hashes.model_dump_json())
    board.client(board.compact_token).upload_blob("r", blob)
    board.restart()  # a board reads the stored keyframes when it starts
    with Follower(board.client(board.read_token), "r", tmp_path / "node", node_id="n1") as node:
        assert node.sync(9) == 9
    assert_view(tmp_path / "node", views[9])

    first, second, *rest = keyframe.tensors
    swapped = keyframe.model_copy(
        update={"tensors": (first.model_copy(update={"blob": second.blob}), second, *rest)}
    )
    (store / "000000000009.json").write_text(swapped.model_dump_json())
    board.restart()
    with Follower(board.client(board.read_token), "r", tmp_path / "other", node_id="n2") as node:
        with pytest.raises(IntegrityError):
            node.sync(9)
        assert node.version is None


def test_the_worker_registers_a_keyframe_when_new_nodes_would_start_far_back(board, tmp_path):
    publish_states(board.client(board.publish_token), "r", SIZES, 12, keyframe_every=100)
    client = board.client(board.compact_token)
    with (
        Follower(client, "r", tmp_path / "w", node_id="w") as follower,
        SpanBuilder(client, "r", follower) as builder,
    ):
        assert compact_head(builder, 7, keyframe_every=8) == 2  # spans of 2 and 4; no keyframe yet
        assert compact_head(builder, 8, keyframe_every=8) == 4  # spans of 2, 4 and 8, the keyframe
        assert compact_head(builder, 9, keyframe_every=8) == 3  # the keyframe at 8 is one back
    reader = board.client(board.read_token)
    assert [s.kind for s in reader.plan("r", None, 8).steps] == ["keyframe"]
    assert [(s.kind, s.version) for s in reader.plan("r", None, 9).steps] == [("keyframe", 8), ("delta", 9)]


def test_retention_keeps_only_the_keyframes_plans_take(run, board, tmp_path):
    _, (keyframe, blob) = run
    compactor = board.client(board.compact_token)
    older, older_blob = keyframe_at(board, tmp_path, 5)
    for k, b in ((keyframe, blob), (older, older_blob)):
        compactor.upload_blob("r", b)
        compactor.register_keyframe("r", k)
    report = board.client().retention("r", RetentionPolicy(keep_last=10, grace_s=0))
    assert report.kept_versions == tuple(range(10))
    store = board.data_dir / "store" / "runs" / "r" / "keyframes"
    assert [p.name for p in store.iterdir()] == ["000000000009.json"]
    reader = board.client(board.read_token)
    assert reader.blob_size("r", keyframe.tensors[0].blob.sha256) == len(blob)
    assert reader.blob_size("r", older.tensors[0].blob.sha256) is None
    assert [s.kind for s in reader.plan("r", None, 9).steps] == ["keyframe"]


def test_the_worker_process_registers_a_keyframe_new_nodes_start_from(board, tmp_path):
    """`deltaboard compact --keyframe-every 8`, fed by the event stream, killed -9 once it
    logged the keyframe of head 9: a new node then starts there and serves version 9."""
    views = publish_states(board.client(board.publish_token), "r", SIZES, 10, keyframe_every=100)
    command = [str(VENV_BIN / "deltaboard"), "compact", "--board", board.url, "--run", "r"]
    worker = subprocess.Popen(
        [*command, "--dir", str(tmp_path / "w"), "--keyframe-every", "8"],
        env={**os.environ, "DELTABOARD_TOKEN": board.compact_token},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stderr is not None
        logged = ""
        for line in worker.stderr:
            if "keyframe 9" in line or "no spans" in line:
                logged = line
                break
    finally:
        worker.kill()
        worker.wait()
    assert "keyframe 9" in logged, logged
    reader = board.client(board.read_token)
    assert [(s.kind, s.version) for s in reader.plan("r", None, 9).steps] == [("keyframe", 9)]
    with Follower(reader, "r", tmp_path / "node", node_id="n1") as node:
        assert node.sync(9) == 9
        assert_view(tmp_path / "node", views[9])
