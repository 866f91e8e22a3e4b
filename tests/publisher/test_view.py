"""The rollout view: round-to-nearest-even casts, pass-through, raw bytes."""

from __future__ import annotations

import numpy as np
import torch

from deltaboard.board.contract.schemas import ViewRule, ViewSpec
from deltaboard.publisher.view import SAFETENSORS_TO_TORCH, rollout_view, safetensors_dtype, tensor_bytes


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of fp32 bit patterns to bf16, NaNs kept quiet NaNs."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def test_bf16_view_is_round_to_nearest_even() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * 0.02).astype(np.float32)
    # exact ties: the low 16 bits are 0x8000, so the result must be the even neighbour
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x00008000], dtype=np.uint32).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, 1e-45], dtype=np.float32)
    x = np.concatenate([x, ties, special])
    view = rollout_view({"w": torch.from_numpy(x.copy())}, ViewSpec())
    assert view["w"].dtype == torch.bfloat16
    got = tensor_bytes(view["w"]).view(np.uint16)
    assert got.tolist() == bf16_reference(x).tolist()
    assert got[-10:-6].tolist() == [0x3F80, 0x3F82, 0xBF80, 0x0000]


def test_nan_stays_nan() -> None:
    view = rollout_view({"w": torch.tensor([float("nan")])}, ViewSpec())
    assert torch.isnan(view["w"]).all()


def test_rules_integers_and_raw() -> None:
    spec = ViewSpec(default_dtype="fp16", rules=(ViewRule(pattern="keep.*", dtype="raw"),))
    state = {
        "w": torch.randn(3, 5),
        "keep.w": torch.randn(2, dtype=torch.float64),
        "ids": torch.arange(7),
        "mask": torch.tensor([True, False, True]),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
    }
    view = rollout_view(state, spec)
    assert [view[k].dtype for k in state] == [
        torch.float16,
        torch.float64,
        torch.int64,
        torch.bool,
        torch.float8_e4m3fn,
    ]
    assert torch.equal(view["ids"], state["ids"])
    assert tensor_bytes(view["f8"]).tobytes() == tensor_bytes(state["f8"]).tobytes()
    assert tensor_bytes(view["mask"]).tolist() == [1, 0, 1]
    assert [safetensors_dtype(view[k]) for k in state] == ["F16", "F64", "I64", "BOOL", "F8_E4M3"]


def test_view_of_bf16_parameters_is_the_parameters() -> None:
    p = torch.randn(4, 4).to(torch.bfloat16)
    view = rollout_view({"p": p}, ViewSpec())
    assert tensor_bytes(view["p"]).tobytes() == tensor_bytes(p).tobytes()


def test_tensor_bytes_of_shapes_and_strides() -> None:
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    assert tensor_bytes(t).tobytes() == np.arange(12, dtype="<i4").tobytes()
    assert tensor_bytes(t.T).tobytes() == np.arange(12, dtype="<i4").reshape(3, 4).T.copy().tobytes()
    assert tensor_bytes(torch.tensor(2.5)).view(np.float32).tolist() == [2.5]
    assert tensor_bytes(torch.zeros(0)).size == 0


def test_uncast_tensors_alias_their_parameter() -> None:
    """Documented: no cast, no copy (the caller copies what must stay old)."""
    p = torch.zeros(3, dtype=torch.bfloat16)
    view = rollout_view({"p": p}, ViewSpec())
    p.add_(1)
    assert view["p"].tolist() == [1.0, 1.0, 1.0]


def test_snapshot_copies_in_shared_pieces_exactly(monkeypatch):
    """The CPU snapshot splits tensors into pieces copied by two threads, and copies small
    ones (batches planned once per buffer) and large ones to cast many per torch call:
    every byte lands, snapshot after snapshot."""
    from deltaboard.publisher import snapshot

    monkeypatch.setattr(snapshot, "_PIECE_BYTES", 1000)  # many uneven pieces per tensor
    g = torch.Generator().manual_seed(1)
    sizes = [1, 777, 5003, 0, 64, *range(100, 140, 3), 499, 500, 2000]

    def state_of_random() -> dict[str, torch.Tensor]:
        state = {f"t{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate(sizes)}
        state["cast"] = torch.randn(900, generator=g)  # fp32, served as bf16: not copyable as bytes
        return state

    layout = snapshot.ViewLayout.of(state_of_random(), ViewSpec())
    buffer = snapshot.ViewBuffer(layout)
    for state in (state_of_random(), state_of_random()):
        buffer.fill(state)
        for slot in layout.slots:
            want = state[slot.name].to(torch.bfloat16).view(torch.int16).numpy().tobytes()
            assert buffer.host_bytes(slot).tobytes() == want


def test_small_host_tensors_are_copied_as_bytes_or_by_torch_exactly(monkeypatch):
    """Small host tensors of one group are copied as bytes in one call where every source
    is a contiguous tensor of its served dtype and shape (views of one flat tensor too),
    by torch where one is not (a cast, a strided view): every byte lands, the padding
    between slots stays zero, snapshot after snapshot."""
    from deltaboard.publisher import memcopy, snapshot

    monkeypatch.setattr(snapshot, "_PIECE_BYTES", 4000)
    gathered: list[int] = []

    def counted(dst: np.ndarray, *args: np.ndarray) -> None:
        gathered.append(len(args[0]))
        memcopy.gather_copy(dst, *args)

    monkeypatch.setattr(snapshot, "gather_copy", counted)
    g = torch.Generator().manual_seed(2)
    flat = torch.empty(3001, dtype=torch.bfloat16)

    def state_of_random(strided: bool) -> dict[str, torch.Tensor]:
        flat.copy_(torch.randn(3001, generator=g))
        state: dict[str, torch.Tensor] = {f"v{i}": flat[i * 300 : i * 300 + 299] for i in range(10)}
        state["fp32"] = torch.randn(77, generator=g)  # another group (served as fp32): its own batch
        state["odd"] = torch.randn(5, generator=g).to(torch.bfloat16)
        rows = torch.randn(9, 2, generator=g).to(torch.bfloat16)
        state["strided"] = rows[:, 0] if strided else rows[:, 0].contiguous()
        return state

    spec = ViewSpec(rules=(ViewRule(pattern="fp32", dtype="fp32"),))
    layout = snapshot.ViewLayout.of(state_of_random(False), spec)
    buffer = snapshot.ViewBuffer(layout)
    for strided in (False, True, False):
        gathered.clear()
        state = state_of_random(strided)
        buffer.fill(state)
        for slot in layout.slots:
            want = state[slot.name].to(SAFETENSORS_TO_TORCH[slot.dtype]).contiguous().view(-1)
            assert buffer.host_bytes(slot).tobytes() == want.view(torch.uint8).numpy().tobytes()
        for group in buffer.groups.values():
            used = torch.zeros(group.numel(), dtype=torch.bool)
            for slot in layout.slots:
                if slot.width == group.element_size():
                    used[slot.offset : slot.offset + slot.numel] = True
            assert not group[~used].any()  # the padding
        # four batches (seven and three views, the fp32 tensor, two small ones): all as
        # bytes but the one with the strided view
        assert len(gathered) == (3 if strided else 4)


def test_a_scalar_snapshot_is_the_view_bit_for_bit_nan_payloads_too():
    """A 0-dim tensor cast to the served dtype: torch converts an f32 NaN to bf16 by one
    path for a scalar (`Tensor.to`, `rollout_view`) and by another in a copy among other
    tensors (0xFFFF where `to` gives 0x7FC0, on the CPU): the snapshot casts scalars as the
    view does, whatever shares its group (found by the device diff's property test)."""
    from deltaboard.publisher import snapshot

    payloads = (0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0xFFC00001, 0x3F800000, 0x80000000)
    scalars = [
        torch.tensor(p, dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(()) for p in payloads
    ]
    for others in (
        {},
        {"t0": torch.randn(5)},
        {"t0": torch.randn(40), "t1": torch.randn(3), "t2": torch.randn(2)},
    ):
        for value in scalars:
            state = {**others, "s": value, "b": value.to(torch.bfloat16)}
            layout = snapshot.ViewLayout.of(state, ViewSpec())
            buffer = snapshot.ViewBuffer(layout)
            buffer.fill(state)
            view = rollout_view(state, ViewSpec())
            for slot in layout.slots:
                assert buffer.host_bytes(slot).tobytes() == tensor_bytes(view[slot.name]).tobytes(), slot.name
