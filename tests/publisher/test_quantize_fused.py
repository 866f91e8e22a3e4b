"""The Triton FP8 quantizer gives the torch reference's codes and scales, bit for bit.

Without CUDA the kernel runs under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set
before Triton is imported) on small CPU tensors; on a GPU the same comparisons run
compiled, plus one at model size.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaboard.publisher.quantize import ScaleRule, quantize_fp8_block

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

RULES: list[ScaleRule] = ["amax", "ue8m0"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def assert_same(w: torch.Tensor, rule: ScaleRule) -> None:
    want_q, want_s = quantize_fp8_block(w, rule, fused=False)
    got_q, got_s = quantize_fp8_block(w, rule, fused=True)
    assert got_q.dtype == torch.float8_e4m3fn and got_q.shape == w.shape
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_s.view(torch.int32), want_s.view(torch.int32))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_value_of_a_16_bit_dtype_is_cast_as_torch_casts_it(dtype: torch.dtype, rule: ScaleRule) -> None:
    """Every bit pattern of the dtype, with each block's largest finite value at 448 (scale
    1 under both rules), so that the kernel's own e4m3 rounding meets every boundary."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    values = torch.where(values.abs() <= 448, values, values.sign() * 448)  # inf, NaN stay
    w = values.reshape(256, 256).clone()
    w[::128, ::128] = 448.0
    assert_same(w.to(DEVICE, dtype), rule)


@pytest.mark.parametrize("rule", RULES)
def test_fp32_bit_patterns_near_every_e4m3_boundary(rule: ScaleRule) -> None:
    """Midpoints between neighbouring e4m3 values and one fp32 step either side (ties to
    even both ways), subnormals of both formats, and signed zeros."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (codes[:-1] + codes[1:]) / 2
    near = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1), codes])
    tiny = torch.tensor([2.0**-149, 2.0**-126, 2.0**-10, 3 * 2.0**-11, 2.0**-7, 0.0, -0.0])
    row = torch.cat([near, -near, tiny, -tiny])
    w = torch.zeros(128, 128 * 5)
    flat = w.view(-1)
    flat[: row.numel()] = row
    w[0, ::128] = 448.0
    assert_same(w.to(DEVICE), rule)


@st.composite
def matrices(draw: st.DrawFn) -> torch.Tensor:
    rows = draw(st.integers(0, 300))
    cols = draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-30, 1e-6, 0.02, 1.0, 1e4, 1e30]))
    w = torch.randn((rows, cols), generator=g) * scale
    for special in draw(
        st.lists(st.sampled_from(["nan", "-nan", "inf", "-inf", "-0", "zero_block"]), max_size=4)
    ):
        mask = torch.rand((rows, cols), generator=g) < 0.05
        if special == "zero_block":
            w[:128, :128] = 0.0
        else:
            w[mask] = {"nan": float("nan"), "-nan": -float("nan"), "inf": float("inf"),
                       "-inf": -float("inf"), "-0": -0.0}[special]  # fmt: skip
    w = w.to(dtype)
    if draw(st.booleans()) and cols > 1:  # rows strided past their length: a column slice
        w = w[:, : cols - 1]
    return w


@settings(max_examples=40, deadline=None)
@given(w=matrices(), rule=st.sampled_from(RULES))
def test_random_matrices_match_the_reference(w: torch.Tensor, rule: ScaleRule) -> None:
    assert_same(w.to(DEVICE), rule)


def test_nan_payloads_and_signs_all_give_the_one_nan_code() -> None:
    bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FFFFFFF], dtype=torch.int64)
    w = torch.zeros(2, 130)
    w[0, :5] = bits.to(torch.int32).view(torch.float32)
    w[1, 129] = 1.0
    q, s = quantize_fp8_block(w.to(DEVICE), "amax", fused=True)
    assert q.view(torch.uint8)[0, :5].tolist() == [0x7F] * 5
    assert_same(w.to(DEVICE), "amax")
    assert np.isfinite(s.cpu().numpy()).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="model-size blocks on a GPU")
def test_model_size_weight_on_the_gpu() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(4096 + 77, 14336 + 5, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    w[5, 7] = float("nan")
    w[9, 9] = -float("inf")
    for rule in RULES:
        assert_same(w, rule)
