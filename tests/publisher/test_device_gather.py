"""`device_gather` copies many tensors' bits into a group buffer by address, bit for bit
(NaN payloads, -0, inf included), and hands back the ones it cannot read so (a cast, a
strided source). Without CUDA the kernel runs under Triton's CPU interpreter on host
tensors (their addresses are host addresses there); on a GPU at CUDA addresses."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (as test_fused_diff)
pytest.importorskip("triton")

from deltaboard.publisher import device_gather  # noqa: E402
from deltaboard.publisher.snapshot import word_aligned  # noqa: E402

SPECIAL_BF16 = [0x7FC0, 0xFFC0, 0x7F81, 0xFFFE, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001]


@pytest.fixture(scope="module", autouse=True)
def small_blocks() -> Iterator[None]:
    """Blocks of 32 elements: tensors of a few hundred cross several block edges."""
    saved, device_gather.BLOCK = device_gather.BLOCK, 32
    yield
    device_gather.BLOCK = saved


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 200), min_size=1, max_size=12),
    kinds=st.lists(st.sampled_from(["plain", "strided", "cast"]), min_size=12, max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_gather_copies_bits_and_hands_back_what_it_cannot_read(sizes, kinds, seed):
    rng = np.random.default_rng(seed)
    offsets = np.concatenate(([0], np.cumsum([word_aligned(n, 2) for n in sizes])))
    out = torch.zeros(int(offsets[-1]) + 4, dtype=torch.int16, device=DEVICE)
    targets, state, want = [], {}, out.clone()
    for i, (n, kind) in enumerate(zip(sizes, kinds, strict=False)):
        name, at = f"t{i}", int(offsets[i])
        bits = rng.integers(-(2**15), 2**15, n, dtype=np.int16)
        bits[: min(n, len(SPECIAL_BF16))] = np.array(SPECIAL_BF16, dtype=np.uint16)[: min(n, 9)].view(
            np.int16
        )
        source = torch.from_numpy(bits).to(DEVICE).view(torch.bfloat16)
        if kind == "strided" and n:
            wide = torch.zeros(n, 2, dtype=torch.bfloat16, device=DEVICE)
            wide[:, 0] = source
            source = wide[:, 0]  # the same values, not contiguous
        if kind == "cast":
            source = source.float()  # a cast on copy: the caller's, by value
            want[at : at + n] = source.to(torch.bfloat16).view(torch.int16)
        else:
            want[at : at + n] = torch.from_numpy(bits).to(DEVICE)
        state[name] = source
        view = out[at : at + n]
        targets.append((name, view.view(torch.bfloat16), view))
    gather = device_gather.DeviceGather(out, targets, offsets[:-1].tolist())
    assert gather.compiled.wait(60), "the kernel did not compile"
    left = gather.copy_from(state)
    # handed back: exactly the sources not readable by address (a cast, or not contiguous)
    handed = {id(t) for t in left[0]}
    for name, typed, bits in targets:
        source = state[name]
        readable = source.dtype == torch.bfloat16 and source.is_contiguous()
        assert (id(typed) in handed or id(bits) in handed) != readable, name
    if left[0]:
        torch._foreach_copy_(left[0], left[1])  # the caller's copy (`ViewBuffer.fill`)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want.cpu())


def test_when_every_source_is_readable_the_kernel_copies_all_and_hands_nothing_back():
    """The common snapshot (every source typed and contiguous, read in one pass of `map`s):
    nothing is left to the caller and every tensor's bits land at its offset, NaN payloads
    included."""
    rng = np.random.default_rng(3)
    sizes, offsets = [7, 0, 130, 1], [0, 8, 8, 140]
    out = torch.zeros(144, dtype=torch.int16, device=DEVICE)
    targets, state = [], {}
    for i, (n, at) in enumerate(zip(sizes, offsets, strict=True)):
        bits = rng.integers(-(2**15), 2**15, n, dtype=np.int16)
        bits[: min(n, len(SPECIAL_BF16))] = np.array(SPECIAL_BF16[:n], dtype=np.uint16).view(np.int16)
        state[f"t{i}"] = torch.from_numpy(bits).to(DEVICE).view(torch.bfloat16)
        view = out[at : at + n]
        targets.append((f"t{i}", view.view(torch.bfloat16), view))
    gather = device_gather.DeviceGather(out, targets, offsets)
    assert gather.compiled.wait(60), "the kernel did not compile"
    assert gather.copy_from(state) == ([], [])
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for (name, _, view), source in zip(targets, state.values(), strict=True):
        assert torch.equal(view.cpu(), source.view(torch.int16).cpu()), name


def test_until_the_kernel_is_compiled_every_tensor_goes_back_to_the_caller():
    """The helper thread compiles the kernel; a snapshot before that copies everything the
    old way (each tensor handed back, as its bits where it is of the served dtype)."""
    out = torch.zeros(16, dtype=torch.int16, device=DEVICE)
    sources = {
        "a": torch.arange(5, dtype=torch.int16, device=DEVICE).view(torch.bfloat16),
        "b": torch.ones(3, device=DEVICE),
    }
    targets = [
        ("a", out[0:5].view(torch.bfloat16), out[0:5]),
        ("b", out[8:11].view(torch.bfloat16), out[8:11]),
    ]
    gather = device_gather.DeviceGather(out, targets, [0, 8])
    assert gather.compiled.wait(60)
    gather.compiled.clear()  # as before the helper is done
    left = gather.copy_from(sources)
    assert [id(t) for t in left[0]] == [id(out_view) for out_view in (targets[0][2], targets[1][1])]
    assert not out.any()  # nothing copied by the kernel
    torch._foreach_copy_(left[0], left[1])
    assert torch.equal(out[0:5].cpu(), torch.arange(5, dtype=torch.int16))
    assert torch.equal(out[8:11].view(torch.bfloat16).float().cpu(), torch.ones(3))
