"""Spans end to end against a real board: built from the deltas by the compaction code,
registered once however many workers race, refused with wrong digests, read back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from deltaboard.board import codec
from deltaboard.board.contract.errors import BadManifest, Forbidden
from deltaboard.board.contract.spans import SpanManifest
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower import Follower
from deltaboard.services.compact.build import build_spans
from tests.clients.support import publish_states

SIZES = {"embed.weight": (128, 32), "layers.0.weight": (32, 32), "layers.0.bias": (32,)}


def built(client: BoardClient, tmp: Path, head: int) -> dict[int, tuple[SpanManifest, bytes]]:
    with Follower(client, "r", tmp / "compact", node_id="compact") as follower:
        return {span.from_version: (span, blob) for span, blob in build_spans(client, "r", follower, head)}


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
            patch = blob[entry.blob.offset : entry.blob.offset + entry.blob.length]
            dtype = entry.dtype
            assert entry.base_digest == codec.digest(views[a][entry.name], dtype)
            assert codec.apply(views[a][entry.name], patch).tobytes() == views[9][entry.name].tobytes()


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


def test_registering_needs_a_publish_token(chain, board):
    _, _, spans = chain
    reader = board.client(board.read_token)
    with pytest.raises(Forbidden):
        reader.register_span("r", spans[7][0])
