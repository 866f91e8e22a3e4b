"""The SGLang and vLLM in-place paths, against imitations that call the hooks as the
engines do and hold tiny transformers models in their fused, TP-sharded layout.

Along a chain of versions every rank's parameters equal the fused layout of the
publisher's view bit for bit; a patch that does not fit one rank leaves every rank as it
was; the layout itself computes the transformers model's logits; and, as properties over
random shapes, mapping a patch's positions agrees with sharding whole tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from deltaboard.board import codec
from deltaboard.clients.engines import sglang_hot, vllm_hot
from deltaboard.clients.engines.fused import Layout, ModelDims
from deltaboard.clients.engines.fused_view import HotPatchRefused
from deltaboard.clients.resident import BaseMismatch, HotPatch, ResidentError, TensorPatch, write_patch
from tests.services.fakes.fused_engines import SGLangState, sglang_app, vllm_app
from tests.services.fakes.fused_models import (
    FusedModel,
    dims_of,
    install_parallel_state,
    rank_models,
    tiny_llama,
    tiny_qwen2,
    tp_logits,
    view_bits,
)

MODELS: dict[str, Callable[[int], PreTrainedModel]] = {"llama": tiny_llama, "qwen2": tiny_qwen2}
View = dict[str, np.ndarray]


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return MODELS[request.param](3)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_the_fused_layout_computes_the_models_logits(model: PreTrainedModel, tp_size: int) -> None:
    ids = torch.tensor([0, 5, 31, 63, 64, 70, model.config.vocab_size - 1, 2])
    with torch.no_grad():
        expected = copy.deepcopy(model).float()(ids[None]).logits[0]  # type: ignore[no-untyped-call]
        got = tp_logits(rank_models(model, view_bits(model), tp_size), model, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def next_view(view: View, rng: np.random.Generator) -> View:
    """A few percent of every tensor's elements moved by one to three bf16 steps."""
    new = {}
    for name, bits in view.items():
        flat = bits.reshape(-1).astype(np.int32)
        moved = rng.random(flat.size) < 0.03
        flat[moved] += rng.integers(1, 4, int(moved.sum())) * rng.choice([-1, 1], int(moved.sum()))
        new[name] = (flat & 0xFFFF).astype(np.uint16).reshape(bits.shape)
    return new


def encode_patch(old: View, new: View, base: int, version: int) -> HotPatch:
    """As a receiver gets it: every changed tensor encoded by the codec, decoded and
    verified against the held bytes."""
    tensors = []
    for name, bits in old.items():
        a, b = bits.reshape(-1).view(np.uint8), new[name].reshape(-1).view(np.uint8)
        if not np.array_equal(a, b):
            changes = codec.decode(codec.encode(a, b, "BF16"), a, codec.digest(a, "BF16"))
            tensors.append(TensorPatch.from_changes(name, changes))
    return HotPatch.from_tensors(base, version, tensors)


@dataclass
class Engine:
    """An imitated engine with its ranks, driven through the client-side hot path."""

    kind: str
    ranks: list[FusedModel]
    hot: sglang_hot.SGLangHotPath | vllm_hot.VLLMHotPath
    sglang: SGLangState

    def stage(self, patch_path: Path, version: int) -> None:
        self.hot.stage(patch_path, version)

    def commit(self, version: int) -> None:
        if isinstance(self.hot, sglang_hot.SGLangHotPath):
            self.hot.commit(version, flush_cache=False)
        else:
            self.hot.commit(version)

    def bits(self) -> list[dict[str, np.ndarray]]:
        return [m.bits() for m in self.ranks]


@pytest.fixture(params=["sglang", "vllm"])
def engine_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def start(
    engine_kind: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[list[FusedModel]], Engine]]:
    install_parallel_state(monkeypatch)
    clients: list[TestClient] = []

    def started(ranks: list[FusedModel]) -> Engine:
        state = SGLangState()
        if engine_kind == "sglang":
            client = TestClient(sglang_app(ranks, [sglang_hot.LOAD_FORMAT], state))
        else:
            client = TestClient(vllm_app(ranks, vllm_hot.EXTENSION))
        clients.append(client)

        def post(path: str, body: dict[str, object]) -> object:
            answer = client.post(path, json=body)
            answer.raise_for_status()
            return answer.json()

        hot = (
            sglang_hot.SGLangHotPath(post, len(ranks))
            if engine_kind == "sglang"
            else vllm_hot.VLLMHotPath(post)
        )
        return Engine(engine_kind, ranks, hot, state)

    yield started
    for client in clients:
        client.close()


def expected_bits(model: PreTrainedModel, view: View, tp_size: int) -> list[dict[str, np.ndarray]]:
    dims = dims_of(model)
    return [Layout(dims, tp_size, rank).build(view) for rank in range(tp_size)]


def assert_ranks_hold(engine: Engine, expected: list[dict[str, np.ndarray]]) -> None:
    for rank, (held, want) in enumerate(zip(engine.bits(), expected, strict=True)):
        assert held.keys() == want.keys()
        for name in want:
            assert np.array_equal(held[name], want[name]), f"rank {rank}: {name}"


@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_rank_follows_a_chain_bit_for_bit(
    model: PreTrainedModel, tp_size: int, start: Callable[[list[FusedModel]], Engine], tmp_path: Path
) -> None:
    rng = np.random.default_rng(tp_size)
    views = [view_bits(model)]
    engine = start(rank_models(model, views[0], tp_size))
    for version in range(1, 4):
        views.append(next_view(views[-1], rng))
        patch = encode_patch(views[-2], views[-1], version - 1, version)
        write_patch(patch, tmp_path / f"{version}.hot")
        engine.stage(tmp_path / f"{version}.hot", version)
        engine.commit(version)
        assert_ranks_hold(engine, expected_bits(model, views[-1], tp_size))
        if engine.kind == "sglang":
            assert (engine.sglang.weight_version, engine.sglang.flushes) == (str(version), 0)


@dataclass
class FirstUpdate:
    """An engine at version 0 and the patch to version 1, written to `path`."""

    engine: Engine
    view: View
    new: View
    patch: HotPatch
    path: Path

    def drift(self, rank: int) -> Callable[[], None]:
        """Flip one bit of the engine's weights on `rank` where the patch changes them
        there; returns the undo."""
        layout = Layout(dims_of(self.engine.ranks[0]), len(self.engine.ranks), rank)
        changed = next(layout.shard(self.patch).tensors())
        param = dict(self.engine.ranks[rank].named_parameters())[changed.name]
        flat, position = param.data.view(torch.int16).view(-1), int(changed.positions[-1])

        def flip() -> None:
            flat[position] ^= 1

        flip()
        return flip


def first_update(model: PreTrainedModel, engine: Engine, tmp_path: Path, seed: int) -> FirstUpdate:
    view = view_bits(model)
    new = next_view(view, np.random.default_rng(seed))
    patch = encode_patch(view, new, 0, 1)
    write_patch(patch, tmp_path / "1.hot")
    return FirstUpdate(engine, view, new, patch, tmp_path / "1.hot")


def test_a_base_one_rank_lacks_leaves_every_rank_unchanged(
    model: PreTrainedModel, start: Callable[[list[FusedModel]], Engine], tmp_path: Path
) -> None:
    update = first_update(model, start(rank_models(model, view_bits(model), 2)), tmp_path, 7)
    engine = update.engine
    undo = update.drift(1)  # only the last rank's copy drifted: only it refuses
    before = engine.bits()
    with pytest.raises(HotPatchRefused, match="rank 1") as refused:
        engine.stage(update.path, 1)
    assert [v.ok for v in refused.value.verdicts] == [True, False]
    with pytest.raises(ResidentError, match="not staged"):  # the ranks that staged it discarded it
        engine.commit(1)
    for held, was in zip(engine.bits(), before, strict=True):
        assert all(np.array_equal(held[n], was[n]) for n in was)
    undo()  # the same patch now applies
    engine.stage(update.path, 1)
    engine.commit(1)
    assert_ranks_hold(engine, expected_bits(model, update.new, 2))


def test_a_patch_sent_twice_is_refused_by_every_rank(
    model: PreTrainedModel, start: Callable[[list[FusedModel]], Engine], tmp_path: Path
) -> None:
    update = first_update(model, start(rank_models(model, view_bits(model), 2)), tmp_path, 8)
    update.engine.stage(update.path, 1)
    update.engine.commit(1)
    with pytest.raises(HotPatchRefused) as refused:
        update.engine.stage(update.path, 1)
    assert all("does not hold the patch's base 0" in v.error for v in refused.value.verdicts)
    assert_ranks_hold(update.engine, expected_bits(model, update.new, 2))


def test_weights_that_drift_between_stage_and_commit_are_restored_loudly(
    model: PreTrainedModel, start: Callable[[list[FusedModel]], Engine], tmp_path: Path
) -> None:
    update = first_update(model, start(rank_models(model, view_bits(model), 1)), tmp_path, 9)
    update.engine.stage(update.path, 1)
    update.drift(0)
    before = update.engine.bits()
    with pytest.raises(BaseMismatch):  # out of the loader: SGLang stops, vLLM fails the RPC
        update.engine.commit(1)
    after = update.engine.bits()
    assert all(np.array_equal(before[0][n], after[0][n]) for n in after[0])


def test_a_patch_for_another_model_is_refused(
    model: PreTrainedModel, start: Callable[[list[FusedModel]], Engine], tmp_path: Path
) -> None:
    update = first_update(model, start(rank_models(model, view_bits(model), 1)), tmp_path, 10)
    renamed = [
        TensorPatch(
            t.name.replace("layers.1.", "layers.7."), t.dtype, t.numel, t.positions, t.old_bits, t.new_bits
        )
        for t in update.patch.tensors()
    ]
    write_patch(HotPatch.from_tensors(0, 1, renamed), update.path)
    with pytest.raises(HotPatchRefused, match="not a tensor of this 2-layer model"):
        update.engine.stage(update.path, 1)
    assert_ranks_hold(update.engine, expected_bits(model, update.view, 1))


def test_an_unreadable_patch_file_is_a_refusal_not_a_crash(
    model: PreTrainedModel, start: Callable[[list[FusedModel]], Engine], tmp_path: Path
) -> None:
    engine = start(rank_models(model, view_bits(model), 2))
    (tmp_path / "1.hot").write_bytes(b"not a patch")
    with pytest.raises(HotPatchRefused, match=r"rank 0: .*rank 1: "):
        engine.stage(tmp_path / "1.hot", 1)
    with pytest.raises(HotPatchRefused, match="FileNotFoundError"):
        engine.stage(tmp_path / "2.hot", 2)
    assert_ranks_hold(engine, expected_bits(model, view_bits(model), 2))


def test_layouts_the_engines_refuse_are_refused() -> None:
    dims = ModelDims.from_config(tiny_llama(0).config.to_dict())
    with pytest.raises(ValueError, match="TP 3"):
        Layout(dims, 3, 0)
    with pytest.raises(ValueError, match="not 'mixtral'"):
        ModelDims.from_config({"model_type": "mixtral"})
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelDims.from_config({**tiny_llama(0).config.to_dict(), "mlp_bias": True})


@st.composite
def layouts(draw: st.DrawFn) -> tuple[ModelDims, int]:
    """Small random shapes and a TP size they divide, uneven vocabulary padding included."""
    tp = draw(st.sampled_from([1, 2, 4]))
    heads = tp * draw(st.integers(1, 3))
    kv = draw(
        st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0 and (k % tp == 0 or tp % k == 0)])
    )
    dims = ModelDims(
        vocab_size=draw(st.integers(1, 40)),
        hidden_size=draw(st.integers(1, 6)),
        intermediate_size=tp * draw(st.integers(1, 3)),
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=draw(st.sampled_from([1, 2, 4])),
        tie_word_embeddings=draw(st.booleans()),
        qkv_bias=draw(st.booleans()),
        o_bias=draw(st.booleans()),
        vocab_padding=draw(st.sampled_from([4, 8, 64])),
    )
    return dims, tp


def holders(name: str, dims: ModelDims, tp: int) -> int:
    """How many ranks hold each element of `name`."""
    if "norm" in name or name.endswith("o_proj.bias"):
        return tp
    if ".k_proj." in name or ".v_proj." in name:
        return max(1, tp // dims.num_kv_heads)
    return 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.integers(0, 2**32 - 1))
def test_mapped_positions_gather_what_the_sharded_tensors_hold(
    drawn: tuple[ModelDims, int], seed: int
) -> None:
    dims, tp = drawn
    rng = np.random.default_rng(seed)
    first = Layout(dims, tp, 0)
    shapes = {n: p.shape for n in first.names() if (p := first.place(n)) is not None}
    old = {n: rng.integers(0, 2**16, s, dtype=np.uint16) for n, s in shapes.items()}
    changed = {n: np.flatnonzero(rng.random(a.size) < 0.3) for n, a in old.items()}
    new = {n: a.copy() for n, a in old.items()}
    for n, where in changed.items():
        new[n].reshape(-1)[where] ^= rng.integers(1, 2**16, where.size, dtype=np.uint16)
    patch = HotPatch.from_tensors(
        0,
        1,
        [
            TensorPatch(
                n, "BF16", a.size, changed[n], a.reshape(-1)[changed[n]], new[n].reshape(-1)[changed[n]]
            )
            for n, a in old.items()
        ],
    )
    held = {n: np.zeros(a.size, dtype=np.int64) for n, a in old.items()}
    for rank in range(tp):
        layout = Layout(dims, tp, rank)
        before, after = layout.build(old), layout.build(new)
        for name, full in old.items():
            p = layout.place(name)
            assert p is not None
            which, where = p.locate(np.arange(full.size))
            held[name][which] += 1
            assert np.array_equal(before[p.param].reshape(-1)[where], full.reshape(-1)[which])
            assert np.array_equal(np.diff(where) > 0, np.ones(max(0, where.size - 1), dtype=bool))
        # the rank's shard of the patch takes its parameters from the old layout to the new
        patched = {n: a.copy() for n, a in before.items()}
        for t in layout.shard(patch).tensors():
            flat = patched[t.name].reshape(-1)
            assert np.array_equal(flat[t.positions], t.old_bits)
            flat[t.positions] = t.new_bits
        assert all(np.array_equal(patched[n], after[n]) for n in after)
        # rows past the vocabulary are padding: zeros, never touched by a patch
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in after:
                real = max(
                    0, min(dims.vocab_size - rank * (dims.padded_vocab // tp), dims.padded_vocab // tp)
                )
                assert not after[name][real:].any()
    for name, count in held.items():
        assert (count == holders(name, dims, tp)).all(), name
