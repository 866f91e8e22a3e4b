"""The publisher against a real board process: versions, failures, fencing, back-pressure."""

from __future__ import annotations

import json
import logging
import re
import threading

import httpx
import pytest
import torch

from deltaboard.board import codec
from deltaboard.board.contract.errors import LeaseHeld
from deltaboard.board.contract.schemas import ViewRule, ViewSpec
from deltaboard.publisher.lease import FencedError
from deltaboard.publisher.publisher import Publisher, PublishError
from tests.publisher.pub_support import (
    FaultyTransport,
    assert_same_view,
    error,
    is_blob_put,
    materialize,
    view_bytes,
)


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g) * 0.02,
        "layer.0.weight": torch.randn(32, 32, generator=g) * 0.02,
        "layer.0.bias": torch.zeros(32),
        "norm.weight": torch.ones(32),
        "step_count": torch.tensor(0, dtype=torch.int64),
    }


def train_step(state: dict[str, torch.Tensor], seed: int) -> None:
    """A sparse change of the bf16 view, like an optimizer step at a small learning rate."""
    g = torch.Generator().manual_seed(1000 + seed)
    for name in ("embed.weight", "layer.0.weight"):
        t = state[name]
        t.add_((torch.randn(t.shape, generator=g) * 0.0005).to(t.device) * t.abs())
    state["step_count"] += 1


def test_a_view_rule_that_matches_no_tensor_is_named_once_per_layout(board, caplog):
    """A regular expression where a glob is meant serves nothing: said at the first publish
    and again when the tensors change, not at every version."""
    client = board.client(board.publish_token)
    state = make_state()
    spec = ViewSpec(rules=(ViewRule(pattern=".*", dtype="raw"), ViewRule(pattern="norm.*", dtype="fp32")))
    with (
        caplog.at_level(logging.WARNING, logger="deltaboard.publisher.publisher"),
        Publisher(client, "run-rules", spec=spec, assets={}) as pub,
    ):
        pub.publish(state, step=0).result()
        pub.publish(state, step=1).result()
        warned = [r.getMessage() for r in caplog.records if "matches no tensor" in r.getMessage()]
        assert len(warned) == 1 and "'.*'" in warned[0] and "norm" not in warned[0], warned
        pub.publish({**state, "extra.weight": torch.ones(4)}, step=2).result()
    warned = [r.getMessage() for r in caplog.records if "matches no tensor" in r.getMessage()]
    assert len(warned) == 2, warned


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_keyframe_then_deltas_rebuild_every_version(board, device):
    client = board.client(board.publish_token)
    state = {k: v.to(device) for k, v in make_state().items()}
    spec = ViewSpec(rules=(ViewRule(pattern="norm.*", dtype="fp32"),))
    views = []
    with Publisher(client, "run-a", spec=spec, keyframe_every=3, assets={"config.json": b'{"a": 1}'}) as pub:
        futures = []
        for v in range(5):
            futures.append(pub.publish(state, step=v, meta={"tag": "t"}))
            views.append(view_bytes(state, spec))
            train_step(state, v)
        results = [f.result() for f in futures]
    assert [r.version for r in results] == [0, 1, 2, 3, 4]
    assert [r.kind for r in results] == ["full", "delta", "delta", "full", "delta"]
    reader = board.client(board.read_token)
    for v, want in enumerate(views):
        manifest = reader.manifest("run-a", v)
        assert manifest.meta == {"tag": "t", "step": v}
        assert manifest.epoch == pub.epoch
        if manifest.kind == "delta":  # only changed tensors, never the untouched bias/norm
            assert {t.name for t in manifest.tensors} == {"embed.weight", "layer.0.weight", "step_count"}
            # what crossed to the host: positions and bits of changed elements, per-slot counts
            assert results[v].host_bytes <= 24 * results[v].changed_elements + 8 * 5
            assert 0 < results[v].changed_elements < results[v].total_elements / 10
        assert {t.name: t.dtype for t in manifest.tensors}.get("norm.weight", "F32") == "F32"
        assert_same_view(materialize(reader, "run-a", v), want)
    # the config says what is served (the view's dtype), not what the trainer holds
    assert json.loads(reader.get_asset("run-a", "config.json")) == {"a": 1, "dtype": "bfloat16"}
    # close() released the lease: a new publisher takes it without stealing
    with Publisher(client, "run-a") as again:
        assert again.next_version == 5


def test_failed_publish_surfaces_and_next_diffs_against_committed(board):
    transport = FaultyTransport()
    client = board.client(board.publish_token, transport=transport, retries=1, backoff_s=0.01)
    state = make_state(1)
    with Publisher(client, "run-f", keyframe_every=100, assets={}) as pub:
        pub.publish(state).result()
        train_step(state, 1)
        transport.rule = lambda r: error(400, "Injected") if is_blob_put(r) else None
        failed = pub.publish(state, step=1)
        with pytest.raises(Exception, match="Injected"):
            failed.result()
        transport.rule = None
        train_step(state, 2)
        ok = pub.publish(state, step=2).result()
    assert (ok.version, ok.kind) == (1, "delta")  # the failed one never became a version
    reader = board.client(board.read_token)
    assert reader.head("run-f").version == 1
    assert reader.manifest("run-f", 1).meta["step"] == 2
    assert_same_view(materialize(reader, "run-f", 1), view_bytes(state))


def test_transient_upload_errors_are_retried(board):
    transport = FaultyTransport()
    client = board.client(board.publish_token, transport=transport, backoff_s=0.01)
    failures = iter([error(503, "Unavailable"), error(503, "Unavailable")])
    transport.rule = lambda r: next(failures, None) if is_blob_put(r) else None
    state = make_state(2)
    with Publisher(client, "run-r", assets={}) as pub:
        result = pub.publish(state).result()
    assert result.version == 0
    assert transport.blob_puts >= 3
    assert_same_view(materialize(board.client(board.read_token), "run-r", 0), view_bytes(state))


def test_fenced_publisher_stops_with_a_clear_error(board):
    state = make_state(3)
    old = Publisher(board.client(board.publish_token), "run-x", holder="trainer-a", assets={})
    old.publish(state).result()
    new = Publisher(
        board.client(board.publish_token), "run-x", holder="trainer-b", steal_lease=True, assets={}
    )
    train_step(state, 1)
    with pytest.raises(FencedError, match="fenced"):
        old.publish(state).result()
    with pytest.raises(FencedError):
        old.publish(state)
    old.close()
    result = new.publish(state).result()  # the new writer starts from a keyframe after head
    new.close()
    assert (result.version, result.kind) == (1, "full")
    assert board.client(board.read_token).head("run-x").epoch == new.epoch


def test_back_pressure_bounds_versions_in_flight(board):
    gate = threading.Event()
    transport = FaultyTransport()
    client = board.client(board.publish_token, transport=transport)
    state = make_state(4)
    pub = Publisher(client, "run-b", max_in_flight=2, assets={})
    transport.rule = lambda r: (gate.wait(30), None)[1] if is_blob_put(r) else None
    first = pub.publish(state)  # allocates buffer 1, the worker holds it while uploads wait
    second = pub.publish(state)  # buffer 2
    third = pub.publish(state)  # buffer 3 = 1 + max_in_flight: the last one there is
    returned = threading.Event()

    def fourth() -> None:
        pub.publish(state)
        returned.set()

    t = threading.Thread(target=fourth)
    t.start()
    assert not returned.wait(0.5)  # every buffer is in flight: publish waits instead of allocating
    assert pub._pipeline.layout is not None
    assert pub.memory_bound_bytes >= pub._pipeline.memory_bytes == 3 * pub._pipeline.layout.nbytes
    gate.set()
    t.join(30)
    assert returned.is_set()
    pub.close()
    assert [f.result().version for f in (first, second, third)] == [0, 1, 2]


def test_lease_is_renewed_in_the_background(board):
    import time

    state = make_state(5)
    with Publisher(board.client(board.publish_token), "run-l", lease_ttl_s=1.5, assets={}) as pub:
        pub.publish(state).result()
        # Longer than the TTL: only renewal keeps the lease. The TTL leaves a renewal (every
        # TTL/3) a second of slack on a busy machine.
        time.sleep(2.0)
        train_step(state, 1)
        assert pub.publish(state).result().version == 1


def test_publish_refuses_after_close(board):
    with Publisher(board.client(board.publish_token), "run-m", assets={}) as pub:
        pub.publish(make_state()).result()
    with pytest.raises(RuntimeError, match="close"):
        pub.publish(make_state())
    assert PublishError.__mro__[1] is RuntimeError


def test_adopted_base_is_checked_against_the_board(board):
    state = make_state(6)
    with Publisher(board.client(board.publish_token), "run-c", assets={}) as pub:
        pub.publish(state).result()
    with Publisher(board.client(board.publish_token), "run-c", assets={}) as pub:
        wrong = dict(state, **{"layer.0.bias": torch.ones(32)})
        with pytest.raises(ValueError, match="not version 0"):
            pub.adopt_base(0, wrong)
    with Publisher(board.client(board.publish_token), "run-c", assets={}) as pub:
        pub.adopt_base(0, state)
        train_step(state, 1)
        result = pub.publish(state).result()
    assert (result.version, result.kind) == (1, "delta")
    assert_same_view(materialize(board.client(board.read_token), "run-c", 1), view_bytes(state))


def delta_encodings(reader, run: str, version: int) -> set[str]:
    manifest = reader.manifest(run, version)
    assert manifest.kind == "delta"
    return {
        codec.read_header(
            reader.get_blob(run, t.blob.sha256, t.blob.offset, t.blob.offset + t.blob.length)
        ).encoding
        for t in manifest.tensors
    }


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_context_encoding_default_and_choice_rebuild_exactly(board, device):
    """`context=True` ships the codec's context encoding (smaller), `False` does not, the
    default (None) does for host tensors only; all rebuild the view bit for bit."""
    client, reader = board.client(board.publish_token), board.client(board.read_token)
    g = torch.Generator().manual_seed(7)
    scale = 10 ** (torch.rand(256, 256, generator=g) * -5)  # magnitudes over five decades
    base = {"w": torch.randn(256, 256, generator=g) * scale}
    sizes = {}
    for context in (False, True, None):
        run = f"ctx-{context}"
        state = {k: v.clone().to(device) for k, v in base.items()}
        with Publisher(client, run, context=context, assets={}) as pub:
            pub.publish(state, step=0).result()
            state["w"].add_(3e-8)  # moves the bf16 bits of the smallest weights only
            result = pub.publish(state, step=1).result()
        assert result.kind == "delta" and result.changed_elements > 0
        assert_same_view(materialize(reader, run, 1), view_bytes(state))
        encodings = delta_encodings(reader, run, 1)
        expected = context if context is not None else device == "cpu"
        assert ("context" in encodings) is expected, encodings
        sizes[context] = result.encoded_bytes
    assert sizes[True] < sizes[False]
    assert sizes[None] == sizes[device == "cpu"]


def test_reordered_names_are_a_delta_and_a_changed_layout_a_keyframe(board):
    state = make_state(8)
    reader = board.client(board.read_token)
    with Publisher(board.client(board.publish_token), "run-t", assets={}) as pub:
        pub.publish(state).result()
        train_step(state, 1)
        reordered = dict(reversed(state.items()))
        same = pub.publish(reordered).result()
        views = {1: view_bytes(state)}
        grown = dict(state, **{"embed.weight": torch.randn(80, 32) * 0.02, "extra.bias": torch.zeros(4)})
        del grown["norm.weight"]
        changed = pub.publish(grown).result()
        train_step(grown, 2)
        after = pub.publish(grown).result()
        views[3] = view_bytes(grown)
    assert (same.kind, same.layout_change) == ("delta", None)
    assert changed.kind == "full" and changed.layout_change is not None
    assert str(changed.layout_change) == "added extra.bias; dropped norm.weight; reshaped embed.weight"
    assert changed.layout_change.reshaped == ("embed.weight",)
    assert (after.kind, after.layout_change) == ("delta", None)
    for version, want in views.items():
        assert_same_view(materialize(reader, "run-t", version), want)


def test_a_restarted_trainer_continues_with_deltas(board):
    state = make_state(9)
    client = board.client(board.publish_token)
    with Publisher(client, "run-s", assets={}) as pub:
        pub.publish(state).result()
        train_step(state, 1)
        pub.publish(state).result()
    # a new process resumed from the checkpoint of version 1: its view is the head's
    with Publisher(client, "run-s", assets={}) as pub:
        resumed = pub.publish(state).result()
        train_step(state, 2)
        after = pub.publish(state).result()
    assert (resumed.version, resumed.resumed, resumed.encoded_bytes) == (1, True, 0)
    assert (after.version, after.kind, after.resumed) == (2, "delta", False)
    reader = board.client(board.read_token)
    assert reader.head("run-s").version == 2
    assert_same_view(materialize(reader, "run-s", 2), view_bytes(state))
    # a trainer whose view is not the head's starts over with a keyframe
    train_step(state, 3)
    with Publisher(client, "run-s", assets={}) as pub:
        other = pub.publish(state).result()
    assert (other.version, other.kind, other.resumed) == (3, "full", False)


def test_a_held_lease_is_explained_in_words(board):
    client = board.client(board.publish_token)
    client.create_run("run-h")
    client.acquire_lease("run-h", "crashed-trainer", ttl_s=120)  # never released
    with pytest.raises(LeaseHeld) as caught:
        Publisher(client, "run-h", assets={})
    message = str(caught.value)
    assert re.search(r"'crashed-trainer', whose lease lasts 1[12]\d s more", message), message
    assert "steal_lease=True to take the run now: the other writer is fenced off" in message
    with Publisher(client, "run-h", assets={}, steal_lease=True) as pub:
        assert pub.publish(make_state()).result().version == 0


class WireRecorder(httpx.HTTPTransport):
    """A real transport that records each answer's body as it came over the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.wire: dict[str, tuple[str, int]] = {}  # path -> (content-encoding, bytes)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        assert isinstance(response.stream, httpx.SyncByteStream)
        raw = b"".join(response.stream)
        self.wire[request.url.path] = (response.headers.get("content-encoding", ""), len(raw))
        return httpx.Response(response.status_code, headers=response.headers, content=raw, request=request)


def test_manifests_are_counted_and_travel_compressed(board):
    g = torch.Generator().manual_seed(10)
    # enough changed tensors that even the delta's manifest is above the board's gzip threshold
    extra = {f"layer.{i}.weight": torch.randn(8, 8, generator=g) * 0.02 for i in range(1, 9)}
    state = {**make_state(10), **extra}
    with Publisher(board.client(board.publish_token), "run-w", assets={}) as pub:
        results = [pub.publish(state).result()]
        train_step(state, 1)
        for t in extra.values():
            t[0, 0] += 1
        results.append(pub.publish(state).result())
    recorder = WireRecorder()
    reader = board.client(board.read_token, transport=recorder)
    for result in results:
        manifest = reader.manifest("run-w", result.version)
        assert result.manifest_bytes == len(manifest.model_dump_json().encode()) > 0
        encoding, wire = recorder.wire[f"/v1/runs/run-w/manifests/{result.version}"]
        # as the board stores it: one zstd frame (`BoardClient`'s httpx accepts zstd)
        assert encoding == "zstd" and wire < result.manifest_bytes / 2, (encoding, wire)


@pytest.mark.parametrize("board_prepares", [True, False])
def test_versions_are_committed_by_the_name_the_board_prepared_them_under(board, board_prepares):
    """The manifest goes to the board while the version's last blob uploads and the commit
    names it; a board that cannot prepare (an older one: no such route) gets the manifest
    itself at the commit. Either way every version reads back exactly."""
    transport = FaultyTransport()
    if not board_prepares:
        transport.rule = lambda r: error(404, "NotFound") if r.url.path.endswith("/prepare") else None
    client = board.client(board.publish_token, transport=transport, backoff_s=0.01)
    state = make_state(5)
    reader = board.client(board.read_token)
    with Publisher(client, "run-p", assets={}) as pub:
        for step in range(3):
            if step:
                train_step(state, step)
            assert pub.publish(state).result().version == step
            assert_same_view(materialize(reader, "run-p", step), view_bytes(state))
    metrics = httpx.get(f"{board.url}/metrics").text
    named = re.search(r"^deltaboard_prepared_commits_total (\S+)$", metrics, re.M)
    assert named is not None and float(named.group(1)) == (3 if board_prepares else 0)
