"""The snapshot buffers and the device diff agree with the codec's host path, bit for bit."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from deltaboard.board import codec
from deltaboard.board.contract.schemas import ViewRule, ViewSpec
from deltaboard.publisher import device_diff
from deltaboard.publisher.device_diff import diff_views
from deltaboard.publisher.snapshot import Slot, ViewBuffer, ViewLayout
from deltaboard.publisher.view import rollout_view, safetensors_dtype, tensor_bytes

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.float8_e4m3fn,
]
SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 65504.0, 3.0e38]


def _tensor(draw: st.DrawFn, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = int(np.prod(shape)) if shape else 1
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g).gt(0.5).reshape(shape)
    if dtype in (torch.int64, torch.int8):
        return torch.randint(-100, 100, (n,), generator=g).to(dtype).reshape(shape)
    base = torch.randn(n, generator=g) * 0.02
    specials = draw(st.lists(st.sampled_from(SPECIAL), max_size=min(n, 4)))
    base[: len(specials)] = torch.tensor(specials, dtype=torch.float32)
    return base.to(dtype).reshape(shape)


def _mutate(draw: st.DrawFn, t: torch.Tensor) -> torch.Tensor:
    """Change a drawn fraction of elements by a bit flip (covers NaN payloads, -0/+0, ULP moves)."""
    out = t.clone()
    flat = out.reshape(-1)
    if flat.numel() == 0:
        return out
    bits = (
        flat.view(torch.uint8)
        if flat.element_size() == 1
        else flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    )
    idx = draw(st.lists(st.integers(0, flat.numel() - 1), max_size=flat.numel(), unique=True))
    if t.dtype == torch.bool:
        bits[idx] = 1 - bits[idx]
        return out
    bit = draw(st.integers(0, flat.element_size() * 8 - 2))
    if idx:
        bits[idx] = bits[idx] ^ (1 << bit)
    return out


@st.composite
def state_pairs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    n = draw(st.integers(1, 5))
    old: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        t = _tensor(draw, dtype, shape)
        old[f"t{i}"] = t
        new[f"t{i}"] = _mutate(draw, t)
    return old, new


SPEC = ViewSpec(rules=(ViewRule(pattern="t1", dtype="fp32"), ViewRule(pattern="t2", dtype="raw")))


# CUDA joins where there is one (the device machine): the same checks, on the tensors' device.
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(state_pairs(), st.integers(1, 64), st.integers(1, 256))
def test_device_diff_matches_codec_diff(device, pair, chunk, batch_bytes):
    old_state, new_state = ({k: v.to(device) for k, v in s.items()} for s in pair)
    layout = ViewLayout.of(old_state, SPEC)
    a, b = ViewBuffer(layout), ViewBuffer(layout)
    a.fill(old_state)
    b.fill(new_state)
    saved = device_diff.CHUNK_ELEMENTS, device_diff.CPU_BATCH_BYTES, device_diff.CUDA_BATCH_BYTES
    # tiny chunks and batches: cross every chunk and batch edge
    device_diff.CHUNK_ELEMENTS, device_diff.CPU_BATCH_BYTES, device_diff.CUDA_BATCH_BYTES = (
        chunk,
        batch_bytes,
        batch_bytes,
    )
    try:
        result = diff_views(a, b)
        # the torch pass (the device path) on the host's tensors too, batch by batch; the
        # CPU view's `diff_views` takes the codec's compiled diff instead
        through_torch = device_diff.ViewDiff()
        for batch in device_diff.batches(layout, batch_bytes):
            through_torch.changes.update(
                device_diff._cut(batch, device_diff._find(a, b, batch, False, False)).changes
            )
    finally:
        device_diff.CHUNK_ELEMENTS, device_diff.CPU_BATCH_BYTES, device_diff.CUDA_BATCH_BYTES = saved
    _assert_same_as_codec(layout, old_state, new_state, a, result)
    _assert_same_as_codec(layout, old_state, new_state, a, through_torch)


def _assert_same_as_codec(
    layout: ViewLayout,
    old_state: dict[str, torch.Tensor],
    new_state: dict[str, torch.Tensor],
    a: ViewBuffer,
    result: device_diff.ViewDiff,
) -> None:
    old_view, new_view = rollout_view(old_state, SPEC), rollout_view(new_state, SPEC)
    changed_total = 0
    for slot in layout.slots:
        assert slot.dtype == safetensors_dtype(new_view[slot.name])
        want = codec.diff(tensor_bytes(old_view[slot.name]), tensor_bytes(new_view[slot.name]), slot.dtype)
        assert np.array_equal(a.host_bytes(slot), tensor_bytes(old_view[slot.name]))
        got = result.changes.get(slot.name)
        if want.count == 0:
            assert got is None
            continue
        assert got is not None
        got.validate()
        assert (got.dtype, got.numel) == (want.dtype, want.numel)
        assert np.array_equal(got.positions, want.positions)
        assert np.array_equal(got.old_bits, want.old_bits)
        assert np.array_equal(got.new_bits, want.new_bits)
        assert got.new_bits.dtype == codec.uint_dtype(slot.dtype)
        changed_total += want.count
    assert result.changed_elements == changed_total


def _device_to_host_copies(trace: Path) -> list[int]:
    """Sizes of the device->host memcpys in a profiler trace (-1 where it names none)."""
    events = json.loads(trace.read_text())["traceEvents"]
    return [
        int(e.get("args", {}).get("bytes", -1))
        for e in events
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_only_changes_cross_to_host(device, tmp_path):
    state = {"w": torch.randn(1000, 100, device=device), "b": torch.randn(100, device=device)}
    layout = ViewLayout.of(state, ViewSpec())
    a, b = ViewBuffer(layout), ViewBuffer(layout)
    a.fill(state)
    state["w"][3, 7] += 1.0
    state["w"][999, 99] += 1.0
    b.fill(state)
    with profile(
        activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device != "cpu" else [])]
    ) as prof:
        result = diff_views(a, b)
    assert result.changed_elements == 2
    # two positions + old and new bf16 bits: nothing near a tensor's size (on CUDA the
    # positions are slot-local int32, and per-slot counts and the context hint cross too:
    # two exponent histograms, a rank per change)
    per_slot, position = (8 * len(layout.slots), 4) if device != "cpu" else (0, 8)
    assert result.host_bytes == 2 * (position + 2 + 2) + per_slot + result.hint_bytes
    assert result.hint_bytes <= (2 * 256 + 2) * 8
    assert list(result.changes["w"].positions) == [307, 99999]
    if device != "cpu":  # what the GPU itself reports: no copy near the 200 KB tensor
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
        copies = _device_to_host_copies(tmp_path / "trace.json")
        assert copies and max(copies) <= result.host_bytes, copies


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the packed copy is CUDA's (CPU tensors are not copied)"
)
def test_a_packed_copy_gives_every_array_aligned_and_in_order():
    """Arrays of mixed widths in one copy (odd int32 and int16 counts ahead of int64 bits,
    as a batch of float64 changes gives them) arrive equal and aligned for the codec's
    compiled code."""
    parts = (
        torch.arange(3, dtype=torch.int16, device="cuda"),
        torch.arange(5, dtype=torch.int32, device="cuda"),
        torch.arange(7, dtype=torch.int64, device="cuda") - 3,
        torch.arange(2, dtype=torch.int8, device="cuda"),
    )
    got = device_diff.to_host(*parts)
    for part, array in zip(parts, got, strict=True):
        assert np.array_equal(array, part.cpu().numpy())
        assert array.ctypes.data % array.itemsize == 0 and array.flags.aligned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's multi-tensor copy")
def test_a_cuda_snapshot_keeps_nan_payloads():
    """Small tensors go through torch's multi-tensor copy on CUDA, whose float path makes
    every NaN canonical: the snapshot must keep the payload bits."""
    bits = torch.tensor([0, -2, 0x7F81, -129, 0x7FC0], dtype=torch.int16)  # NaNs of both signs, payloads
    state = {"w": bits.view(torch.bfloat16).cuda(), "u": torch.tensor([float("nan")] * 3, device="cuda")}
    state["u"].view(torch.int32)[1] = 0x7F800001
    layout = ViewLayout.of(state, ViewSpec(rules=(ViewRule(pattern="*", dtype="raw"),)))
    buffer = ViewBuffer(layout)
    buffer.fill(state)
    for slot in layout.slots:
        assert np.array_equal(buffer.host_bytes(slot), tensor_bytes(state[slot.name].cpu())), slot.name


@st.composite
def float_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """An old tensor with a spread of exponents and a new one whose changes favour small
    weights (so that the classes often pay off and the context hint is exercised)."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
    n = draw(st.sampled_from([1, 7, 300, 5000, 70000]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old = (
        torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 1, (n,), generator=g)
    ).to(dtype)
    specials = draw(st.lists(st.sampled_from(SPECIAL), max_size=min(n, 4)))
    old[: len(specials)] = torch.tensor(specials, dtype=torch.float64).to(dtype)
    rate = draw(st.sampled_from([0.001, 0.05, 0.5]))
    small = old.abs().to(torch.float64).nan_to_num(1.0) < 1e-3
    moved = (
        (torch.rand(n, generator=g, dtype=torch.float64) < torch.where(small, rate, rate / 20))
        .nonzero()
        .flatten()
    )
    bits = old.clone().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[old.element_size()])
    bits[moved] += torch.randint(-3, 4, (moved.numel(),), generator=g).to(bits.dtype)
    return old, bits.view(dtype)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(float_pairs(), st.sampled_from([1000, 1 << 26]))
def test_device_context_hint_matches_codec(device, pair, rank_chunk):
    """The torch path of the hint (on CPU tensors, and on CUDA where there is one) equals
    the codec's numpy hint, and a patch made from it alone (no old bytes) applies exactly."""
    old_t, new_t = pair
    state_old, state_new = {"w": old_t.to(device)}, {"w": new_t.to(device)}
    layout = ViewLayout.of(state_old, ViewSpec(rules=(ViewRule(pattern="w", dtype="raw"),)))
    a, b = ViewBuffer(layout), ViewBuffer(layout)
    a.fill(state_old)
    b.fill(state_new)
    saved = device_diff.RANK_CHUNK_ELEMENTS
    device_diff.RANK_CHUNK_ELEMENTS = rank_chunk  # small chunks: cross chunk edges
    try:
        result = diff_views(a, b, hints=True)
    finally:
        device_diff.RANK_CHUNK_ELEMENTS = saved
    slot = layout.slots[0]
    old_bytes, new_bytes = tensor_bytes(old_t), tensor_bytes(new_t)
    changes = result.changes.get("w")
    if changes is None:
        assert "w" not in result.hints
        return
    want = codec.context_hint(changes, old_bytes.view(codec.uint_dtype(slot.dtype)))
    got = result.hints.get("w")
    if want is None:
        assert got is None
        return
    assert got is not None
    assert (got.t_low, got.t_top) == (want.t_low, want.t_top)
    assert np.array_equal(got.ranks, want.ranks)
    base = codec.digest(old_bytes, slot.dtype)
    patch = codec.encode_changes(changes, None, slot.dtype, old_digest=base, hint=got)
    assert codec.read_header(patch).encoding in ("context", "dense")
    assert np.array_equal(codec.apply(old_bytes, patch), new_bytes)


def test_layout_change_names_what_changed_and_ignores_order():
    layout = ViewLayout.of({"w": torch.zeros(4), "u": torch.zeros(2)}, ViewSpec())
    assert layout.change({"u": torch.ones(2), "w": torch.ones(4)}, ViewSpec()) is None
    assert layout.change({"w": torch.ones(4), "u": torch.ones(2)}, ViewSpec()) is None
    cases = {
        "reshaped w": {"w": torch.zeros(5), "u": torch.zeros(2)},
        "reshaped u": {"u": torch.zeros(3), "w": torch.zeros(4)},
        "added v; dropped u": {"w": torch.zeros(4), "v": torch.zeros(4)},
        "added v": {"w": torch.zeros(4), "u": torch.zeros(2), "v": torch.zeros(1)},
    }
    for said, state in cases.items():
        assert str(layout.change(state, ViewSpec())) == said


def _many_batches(monkeypatch: pytest.MonkeyPatch) -> tuple[ViewBuffer, ViewBuffer]:
    """Two buffers of twelve changed tensors, one batch each."""
    g = torch.Generator().manual_seed(11)
    old = {f"t{i:02d}": torch.randn(64, generator=g).to(torch.bfloat16) for i in range(12)}
    new = {k: (v.view(torch.int16) + 1).view(torch.bfloat16) for k, v in old.items()}
    layout = ViewLayout.of(old, ViewSpec())
    a, b = ViewBuffer(layout), ViewBuffer(layout)
    a.fill(old)
    b.fill(new)
    monkeypatch.setattr(device_diff, "CPU_BATCH_BYTES", 1)
    return a, b


def test_a_caller_that_stops_early_stops_the_diff_helper(monkeypatch):
    """The helpers diff batches ahead of the caller: a caller that stops (an encode that
    failed) must not leave one waiting forever, which would hang the generator's close."""
    a, b = _many_batches(monkeypatch)
    diffs = device_diff.iter_diffs(a, b)
    assert next(diffs).changes
    closed = threading.Thread(target=diffs.close)
    closed.start()
    closed.join(timeout=120)
    assert not closed.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("deltaboard-diff")]


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_layout_of_the_same_slots_never_compares_them(device, monkeypatch):
    """The tables cached per batch are found by the batch itself: a publisher made again for
    the same model (a second layout of equal slots) diffs without comparing slots, where
    content-keyed caches compared the two layouts' batches slot by slot at every lookup."""
    g = torch.Generator().manual_seed(5)
    old = {f"t{i:02d}": torch.randn(64, generator=g).to(torch.bfloat16).to(device) for i in range(12)}
    new = {k: (v.view(torch.int16) + 1).view(torch.bfloat16) for k, v in old.items()}

    def diffed_in_a_new_layout() -> device_diff.ViewDiff:
        layout = ViewLayout.of(old, ViewSpec())
        a, b = ViewBuffer(layout), ViewBuffer(layout)
        a.fill(old)
        b.fill(new)
        return diff_views(a, b, hints=True)

    def compared(self: object, other: object) -> bool:
        raise AssertionError("a cache lookup compared slots")

    first = diffed_in_a_new_layout()
    monkeypatch.setattr(Slot, "__eq__", compared)
    second = diffed_in_a_new_layout()
    assert sorted(first.changes) == sorted(second.changes) == sorted(old)
    for name, changes in first.changes.items():
        assert np.array_equal(changes.positions, second.changes[name].positions)
        assert np.array_equal(changes.new_bits, second.changes[name].new_bits)


def _hint_versions(device: str, seed: int) -> list[dict[str, torch.Tensor]]:
    """Four versions of a sampled tensor (every 32nd element counted), three unsampled ones
    (two of a narrower exponent field, in a batch of their own) and an integer one, whose
    changes favour small weights, sampled positions included."""
    g = torch.Generator().manual_seed(seed)
    first = {
        "big": (torch.randn(70_000, generator=g) * 10.0 ** torch.randint(-6, 1, (70_000,), generator=g)).to(
            torch.bfloat16
        ),
        "small": (torch.randn(3_000, generator=g) * 1e-4).to(torch.float32),
        # two in one batch of their own: 16 exponents each in a table 256 wide (the widest dtype's)
        **{
            name: (torch.randn(n, generator=g) * 10.0 ** torch.randint(-2, 1, (n,), generator=g)).to(
                torch.float8_e4m3fn
            )
            for name, n in (("eights", 4_000), ("more_eights", 2_500))
        },
        "ints": torch.randint(0, 9, (100,), generator=g),
    }
    versions = [first]
    for _ in range(3):
        nxt = {}
        for name, t in versions[-1].items():
            bits = t.clone().view(
                {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
            )
            small = (
                t.to(torch.float64).abs() < (1e-3 if t.element_size() > 1 else 0.05)
                if t.is_floating_point()
                else torch.ones_like(t, dtype=torch.bool)
            )
            moved = (torch.rand(t.numel(), generator=g) < torch.where(small, 0.2, 0.01)).nonzero().flatten()
            bits[moved] += torch.randint(1, 40, (moved.numel(),), generator=g).to(bits.dtype)
            nxt[name] = bits.view(t.dtype)
        versions.append(nxt)
    return [{k: v.to(device) for k, v in state.items()} for state in versions]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [1, 2])
def test_kept_sampled_counts_give_the_codecs_hint_version_after_version(device, seed):
    """The device hint plans from sampled counts counted once, then moved by each delta's
    changes into the new buffer's table: version after version (the two buffers taking
    turns, as the publisher's do) its thresholds and ranks stay the codec's, the new
    buffer's counts are its bytes' own, and a version that failed (its buffer filled again
    with another state) leaves the base's counts true, those the base was counted to as
    well."""
    v = _hint_versions(device, seed)
    spec = ViewSpec(rules=(ViewRule(pattern="*", dtype="raw"),))  # every dtype served as it is
    layout = ViewLayout.of(v[0], spec)
    assert {slot.dtype for slot in layout.slots} == {"BF16", "F32", "F8_E4M3", "I64"}
    base, other = ViewBuffer(layout), ViewBuffer(layout)
    base.fill(v[0])
    hinted, checked = 0, set()
    for old_state, new_state, commit in (
        (v[0], v[1], False),
        (v[0], v[2], True),
        (v[2], v[1], False),
        (v[2], v[3], True),
    ):
        other.fill(new_state)
        result = diff_views(base, other, hints=True)
        for slot in layout.slots:
            changes = result.changes.get(slot.name)
            got = result.hints.get(slot.name)
            old_bits = tensor_bytes(old_state[slot.name].cpu()).view(codec.uint_dtype(slot.dtype))
            floating = slot.dtype in codec.EXPONENT_FIELDS
            want = codec.context_hint(changes, old_bits) if changes is not None and floating else None
            assert (got is None) == (want is None), slot.name
            if got is not None and want is not None:
                hinted += 1
                assert (got.t_low, got.t_top) == (want.t_low, want.t_top), slot.name
                assert np.array_equal(got.ranks, want.ranks), slot.name
        # the new buffer's kept counts are its own bytes' sampled counts, row by row
        kept = other.sampled_counts
        assert kept is not None
        for row, slot in enumerate(layout.slots):
            if slot.dtype in codec.EXPONENT_FIELDS and kept.table[row, 0] >= 0:
                new_bits = tensor_bytes(new_state[slot.name].cpu()).view(codec.uint_dtype(slot.dtype))
                sample = new_bits[:: codec.sample_stride(slot.numel)]
                counted = codec.exponent_counts(np.ascontiguousarray(sample), slot.dtype)
                assert np.array_equal(kept.table[row, : counted.size], counted), slot.name
                checked.add(slot.dtype)
        if commit:
            base, other = other, base
    assert hinted >= 3  # the classes paid off: the counts were used, not just carried
    assert checked == {"BF16", "F32", "F8_E4M3"}  # moved counts of every floating dtype compared
