"""Spans end to end against a real board: built from the deltas by the compaction code,
registered once however many workers race, refused with wrong digests, read back."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from deltaboard.board import codec
from deltaboard.board.contract.errors import BadManifest, Forbidden
from deltaboard.board.contract.schemas import RetentionPolicy, TensorPart
from deltaboard.board.contract.spans import SpanEntry, SpanManifest
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower import Follower, IntegrityError
from deltaboard.services.bench import follow_bench
from deltaboard.services.compact.build import SpanBuilder
from deltaboard.services.compact.worker import compact_head
from tests.clients.support import assert_view, publish_states
from tests.support.servers import VENV_BIN

SIZES = {"embed.weight": (128, 32), "layers.0.weight": (32, 32), "layers.0.bias": (32,)}


def built(client: BoardClient, tmp: Path, head: int) -> dict[int, tuple[SpanManifest, bytes]]:
    with (
        Follower(client, "r", tmp / "compact", node_id="compact") as follower,
        SpanBuilder(client, "r", follower) as builder,
    ):
        return {span.from_version: (span, blob) for span, blob in builder.build(head)}


def patch_of(blob: bytes, entry: SpanEntry) -> bytes:
    return blob[entry.blob.offset : entry.blob.offset + entry.blob.length]


@pytest.fixture
def chain(board, tmp_path):
    """A run of 10 versions (one keyframe), and the spans ending at version 9."""
    publisher = board.client(board.publish_token)
    views = publish_states(publisher, "r", SIZES, 10, keyframe_every=100)
    return publisher, views, built(publisher, tmp_path, 9)


def test_spans_end_at_head_in_powers_of_two_and_patch_like_the_deltas(chain):
    _, views, spans = chain
    assert sorted(spans) == [1, 5, 7]  # 8, 4 and 2 versions back; 16 would cross the keyframe
    for a, (span, blob) in spans.items():
        assert {t.name for t in span.tensors} == {
            n for n in SIZES if views[a][n].tobytes() != views[9][n].tobytes()
        }
        for entry in span.tensors:
            patch = patch_of(blob, entry)
            dtype = entry.dtype
            assert entry.base_digest == codec.digest(views[a][entry.name], dtype)
            assert codec.apply(views[a][entry.name], patch).tobytes() == views[9][entry.name].tobytes()


class CountingClient(BoardClient):
    """Records the blobs it downloads whole (the worker's deltas)."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(url, token)
        self.fetched: list[str] = []

    def get_blob(self, run: str, sha256: str, start: int | None = None, end: int | None = None) -> bytes:
        self.fetched.append(sha256)
        return super().get_blob(run, sha256, start, end)


def test_each_head_is_built_from_the_last_one(board, tmp_path):
    """One builder for heads 9, 10, 11 and 13: each next head downloads and decodes only
    its own delta, and its spans are bit for bit those of a fresh worker; past the
    keyframe at 12 there is no span to build (none crosses it)."""
    publisher = board.client(board.publish_token)
    publish_states(publisher, "r", SIZES, 14, keyframe_every=12)
    assert publisher.manifest("r", 12).kind == "full"
    counting = CountingClient(board.url, board.compact_token)
    with (
        counting,
        Follower(counting, "r", tmp_path / "w", node_id="w") as follower,
        SpanBuilder(counting, "r", follower) as builder,
    ):
        builder.build(9)
        for head in (10, 11, 13):
            counting.fetched.clear()
            spans = {span.from_version: (span, blob) for span, blob in builder.build(head)}
            assert spans == built(publisher, tmp_path / f"fresh-{head}", head)
            assert follower.version == head
            if head != 13:
                assert sorted(set(counting.fetched)) == sorted(publisher.manifest("r", head).blob_shas())
        assert spans == {}


def test_registration_is_idempotent_and_racing_workers_leave_one_span(chain, board):
    publisher, _, spans = chain
    span, blob = spans[1]
    publisher.upload_blob("r", blob)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: publisher.register_span("r", span), range(6)))
    assert sorted(a.created for a in answers) == [False] * 5 + [True]
    reader = board.client(board.read_token)
    assert reader.span("r", 1, 9) == span
    assert publisher.register_span("r", span).created is False
    stored = list((board.data_dir / "store" / "runs" / "r" / "spans").iterdir())
    assert [p.name for p in stored] == ["000000000001-000000000009.json"]


def test_wrong_digests_are_refused_with_422_and_nothing_is_stored(chain, board):
    publisher, _, spans = chain
    span, blob = spans[5]
    publisher.upload_blob("r", blob)
    first = span.tensors[0]
    whole = TensorPart(offset=(0,) * len(first.shape), shape=first.shape, digest=first.digest)
    wrong = [
        span.model_copy(
            update={"tensors": (first.model_copy(update={"digest": "0" * 32}), *span.tensors[1:])}
        ),
        span.model_copy(
            update={"tensors": (first.model_copy(update={"base_digest": "0" * 32}), *span.tensors[1:])}
        ),
        span.model_copy(update={"tensors": span.tensors[1:]}),  # a changed tensor left out
        span.model_copy(update={"state_digest": spans[7][0].base_state_digest}),
        span.model_copy(update={"from_version": 8}),  # one version is a delta, not a span
        span.model_copy(update={"tensors": (first.model_copy(update={"part": whole}), *span.tensors[1:])}),
    ]
    for bad in wrong:
        with pytest.raises(BadManifest) as refused:
            publisher.register_span("r", bad)
        assert refused.value.http_status == 422
    answer = httpx.get(
        f"{board.url}/v1/runs/r/spans/5/9", headers={"Authorization": f"Bearer {board.read_token}"}
    )
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "UnknownVersion"
    assert not (board.data_dir / "store" / "runs" / "r" / "spans").exists()


def test_a_compact_token_registers_spans_but_cannot_publish(chain, board):
    """The worker's scope: blobs and spans yes; a lease, a commit, a run or an asset no
    (403 `Forbidden`, the typed class); a read token cannot register a span."""
    publisher, _, spans = chain
    span, blob = spans[7]
    reader = board.client(board.read_token)
    with pytest.raises(Forbidden):
        reader.register_span("r", span)
    compactor = board.client(board.compact_token)
    compactor.upload_blob("r", blob)
    assert compactor.register_span("r", span).created
    manifest = publisher.manifest("r", 9)
    refused: list[Callable[[], object]] = [
        lambda: compactor.acquire_lease("r", "compact"),
        lambda: compactor.commit("r", manifest.model_copy(update={"version": 10, "parent": 9})),
        lambda: compactor.create_run("r2"),
        lambda: compactor.put_asset("r", "config.json", b"{}"),
        lambda: compactor.retention("r"),
    ]
    for call in refused:
        with pytest.raises(Forbidden) as denied:
            call()
        assert denied.value.http_status == 403
    assert publisher.head("r").version == 9


def test_a_node_behind_catches_up_by_one_span(chain, board, tmp_path):
    publisher, views, spans = chain
    reader = board.client(board.read_token)
    with Follower(reader, "r", tmp_path / "node", node_id="n1") as node:
        node.sync(1)
        replay = reader.plan("r", 1, 9)
        for span, blob in spans.values():
            publisher.upload_blob("r", blob)
            publisher.register_span("r", span)
        plan = reader.plan("r", 1, 9)
        assert (plan.strategy, [s.kind for s in plan.steps]) == ("spans", ["span"])
        assert plan.total_bytes + plan.manifest_bytes < replay.total_bytes + replay.manifest_bytes
        assert node.sync(9) == 9
        assert_view(tmp_path / "node", views[9])


def test_a_span_with_wrong_patches_is_refused_by_the_follower(chain, board, tmp_path):
    """A span that passed no board's checks (written into the store behind its back) whose
    patches are another span's: the follower refuses it and serves the version it held."""
    publisher, views, spans = chain
    (good, _), (other, other_blob) = spans[1], spans[5]
    publisher.upload_blob("r", other_blob)
    blobs = {e.name: e.blob for e in other.tensors}
    fallback = other.tensors[0].blob
    swapped = tuple(e.model_copy(update={"blob": blobs.get(e.name, fallback)}) for e in good.tensors)
    forged = good.model_copy(update={"tensors": swapped})
    store = board.data_dir / "store" / "runs" / "r" / "spans"
    store.mkdir(parents=True)
    (store / "000000000001-000000000009.json").write_text(forged.model_dump_json())
    board.restart()  # a board reads the stored spans when it starts
    reader = board.client(board.read_token)
    with Follower(reader, "r", tmp_path / "node", node_id="n1") as node:
        node.sync(1)
        assert [s.kind for s in reader.plan("r", 1, 9).steps] == ["span"]
        with pytest.raises(IntegrityError):
            node.sync(9)
        assert node.version == 1
        assert_view(tmp_path / "node", views[1])


def test_a_node_32_behind_fetches_under_0_4x_the_replay(board, tmp_path):
    """On the synthetic view with the recorded run's change statistics (`bench follow`'s)."""
    config = follow_bench.BenchConfig(view_gb=0.004, tensor_elements=1 << 18)
    trainer = follow_bench.SyntheticTrainer(config, follow_bench.trajectory_stats())
    client, run = board.client(board.publish_token), follow_bench.RUN
    follow_bench.publish(client, trainer, 33, lambda _: None)
    replay = client.plan(run, 0, 32)
    with (
        Follower(client, run, tmp_path / "compact", node_id="compact") as worker,
        SpanBuilder(client, run, worker) as builder,
    ):
        assert compact_head(builder, 32) == 5  # spans of 2, 4, 8, 16 and 32 versions
    plan = client.plan(run, 0, 32)
    assert [s.kind for s in plan.steps] == ["span"]
    ratio = (plan.total_bytes + plan.manifest_bytes) / (replay.total_bytes + replay.manifest_bytes)
    assert ratio <= 0.4, ratio
    with Follower(board.client(board.read_token), run, tmp_path / "node", node_id="n1") as node:
        node.sync(0)
        node.sync(32)
        assert_view(tmp_path / "node", {n: b.view(np.uint8) for n, b in trainer.bits.items()})


def test_kill_9_of_the_worker_leaves_only_complete_verified_spans(board, tmp_path):
    """The worker is killed as soon as it has registered its first span of head 9 (the
    others built or uploading): every span the board shows is whole and patches exactly."""
    views = publish_states(board.client(board.publish_token), "r", SIZES, 10, keyframe_every=100)
    worker = subprocess.Popen(
        [
            str(VENV_BIN / "deltaboard"),
            "compact",
            "--board",
            board.url,
            "--run",
            "r",
            "--dir",
            str(tmp_path / "w"),
        ],
        env={**os.environ, "DELTABOARD_TOKEN": board.compact_token},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stderr is not None
        for line in worker.stderr:
            if " span " in line:
                break
        worker.kill()
    finally:
        worker.kill()
        worker.wait()
    reader = board.client(board.read_token)
    stored = sorted((board.data_dir / "store" / "runs" / "r" / "spans").iterdir())
    assert stored, "the worker registered a span before it was killed"
    for path in stored:
        a, b = (int(part) for part in path.stem.split("-"))
        span = reader.span("r", a, b)
        for entry in span.tensors:
            patch = reader.get_blob("r", entry.blob.sha256)[
                entry.blob.offset : entry.blob.offset + entry.blob.length
            ]
            assert codec.apply(views[a][entry.name], patch).tobytes() == views[b][entry.name].tobytes()


def test_retention_keeps_the_spans_plans_take_and_their_blobs(chain, board):
    """The span 1 -> 9 reaches the store behind this board's back (as through another
    replica): retention still reads it, and keeps it and its blob (a plan from 1 takes it)."""
    publisher, _, spans = chain
    for a in (1, 5):
        publisher.upload_blob("r", spans[a][1])
    publisher.register_span("r", spans[5][0])
    store = board.data_dir / "store" / "runs" / "r" / "spans"
    (store / "000000000001-000000000009.json").write_text(spans[1][0].model_dump_json())
    report = board.client().retention("r", RetentionPolicy(keep_last=9, grace_s=0))
    assert report.kept_versions == tuple(range(10))
    assert "000000000001-000000000009.json" in [p.name for p in store.iterdir()]
    reader = board.client(board.read_token)
    assert reader.blob_size("r", spans[1][0].tensors[0].blob.sha256) == len(spans[1][1])
    assert [s.kind for s in reader.plan("r", 1, 9).steps] == ["span"]
