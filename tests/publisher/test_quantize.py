"""The block FP8 quantizer against a plain reference written from its docstring.

The reference walks blocks and elements in Python: fp32 arithmetic through numpy
scalars, and the e4m3fn cast as a search of the 256 codes for the nearest value (ties to
the even code), so that it shares nothing with torch's vectorised path.
"""

from __future__ import annotations

import bisect
import json
import math
from typing import NoReturn

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaboard.board.contract.schemas import ViewRule, ViewSpec
from deltaboard.board.contract.view_spec import FP8_BLOCK, fp8_view
from deltaboard.publisher.assets import describe_view
from deltaboard.publisher.quantize import (
    BLOCK,
    ScaleRule,
    dequantize_fp8_block,
    quantize_fp8_block,
    quantize_state,
)
from deltaboard.publisher.view import rollout_view


def _code_value(code: int) -> float:
    """The value of an e4m3fn code (NaN for 0x7F/0xFF)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


POSITIVE = [_code_value(c) for c in range(0x7F)]  # codes 0 .. 0x7E: 0 .. 448, ascending


def ref_cast(x: float) -> int:
    """Round a finite |x| <= 448 to nearest e4m3fn, ties to the even code: of the two
    codes around |x|, the nearer, or the even one when both are as near."""
    a = abs(x)
    above = bisect.bisect_left(POSITIVE, a)
    candidates = [c for c in (above - 1, above) if 0 <= c < len(POSITIVE)]
    code = min(candidates, key=lambda c: (abs(POSITIVE[c] - a), c & 1))
    return code | (0x80 if math.copysign(1.0, x) < 0 else 0)


def ref_scale(amax: np.float32, rule: ScaleRule) -> np.float32:
    s = np.float32(amax) / np.float32(448.0)
    if s == 0:
        return np.float32(1.0)
    if rule == "ue8m0":
        if s < 2.0**-126:
            return np.float32(2.0**-126)
        mantissa, exponent = math.frexp(float(s))
        return s if mantissa == 0.5 else np.float32(2.0**exponent)
    return s


def reference(w: np.ndarray, rule: ScaleRule) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes, fp32 scales) of a float32 matrix, block by block."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    codes = np.zeros((rows, cols), np.uint8)
    scales = np.zeros((br, bc), np.float32)
    for i in range(br):
        for j in range(bc):
            block = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            finite = [abs(float(v)) for v in block.flat if math.isfinite(v)]
            s = ref_scale(np.float32(max(finite, default=0.0)), rule)
            scales[i, j] = s
            for (r, c), v in np.ndenumerate(block):
                if math.isnan(v):
                    code = 0x7F
                else:
                    scaled = np.float32(v) / s
                    code = ref_cast(float(min(max(scaled, np.float32(-448.0)), np.float32(448.0))))
                codes[i * BLOCK + r, j * BLOCK + c] = code
    return codes, scales


def check(w: np.ndarray, rule: ScaleRule = "amax") -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_fp8_block(torch.from_numpy(w), rule)
    codes, scales = reference(w, rule)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == w.shape and s.shape == scales.shape
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), codes)
    np.testing.assert_array_equal(s.numpy().view(np.uint32), scales.view(np.uint32))
    return q, s


@pytest.mark.parametrize("rule", ["amax", "ue8m0"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (128, 128), (129, 130), (257, 5), (0, 7)])
def test_matches_the_reference_on_ragged_shapes(shape: tuple[int, int], rule: ScaleRule) -> None:
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 300.0], size=shape)).astype(np.float32)
    check(w, rule)


@pytest.mark.parametrize("rule", ["amax", "ue8m0"])
def test_all_zero_blocks_get_scale_one_and_keep_the_sign_of_zero(rule: ScaleRule) -> None:
    w = np.zeros((130, 260), np.float32)
    w[0, :5] = -0.0
    w[129, 259] = 2.0  # the ragged corner block is the only one with a value
    q, s = check(w, rule)
    assert s[0, 0] == 1.0 and s[0, 1] == 1.0
    assert q.view(torch.uint8)[0, :5].tolist() == [0x80] * 5
    assert q.view(torch.uint8)[1, :5].tolist() == [0] * 5
    assert q.view(torch.uint8)[129, 259] == (0x7E if rule == "amax" else 0x78)  # 448; 256 under ue8m0


def test_values_at_the_fp8_limits() -> None:
    w = np.zeros((4, 8), np.float32)
    w[0] = [448.0, -448.0, 464.0, 2.0**-9, -(2.0**-9), 2.0**-10, 3 * 2.0**-11, 240.0]
    w[1, :2] = [3.4028235e38, -3.4028235e38]  # fp32's largest
    w[2, :2] = [2.0**-126, 1e-45]  # fp32's smallest normal and subnormal
    check(w, "ue8m0")
    codes = check(w, "amax")[0].view(torch.uint8)
    assert codes[1, 0] == 0x7E and codes[1, 1] == 0xFE  # the block's amax lands on +-448
    one_block = np.array([[448.0, -448.0, 2.0**-9, -(2.0**-9), 2.0**-10, 3 * 2.0**-10]], np.float32)
    q, s = check(one_block)
    assert s[0, 0] == 1.0  # amax 448: values are e4m3fn values already
    assert q.view(torch.uint8)[0].tolist() == [0x7E, 0xFE, 0x01, 0x81, 0x00, 0x02]  # ties to the even code


def test_a_block_whose_scale_underflows_gets_scale_one() -> None:
    w = np.array([[1e-45, -1e-45]], np.float32)  # amax / 448 is 0 in fp32
    q, s = check(w)
    assert s[0, 0] == 1.0 and q.view(torch.uint8)[0].tolist() == [0x00, 0x80]


def test_nan_and_inf_in_the_master() -> None:
    w = np.ones((129, 3), np.float32)
    nan_neg = np.array([0xFFC00001], np.uint32).view(np.float32)[0]  # negative NaN with a payload
    w[0] = [np.nan, np.inf, -np.inf]
    w[1, 0] = nan_neg
    w[128] = np.nan  # a ragged block of only NaN: amax 0, scale 1
    for rule in ("amax", "ue8m0"):
        q, s = check(w, rule)
        codes = q.view(torch.uint8)
        assert codes[0].tolist() == [0x7F, 0x7E, 0xFE] and codes[1, 0] == 0x7F
        assert s[0, 0] == (np.float32(1.0) / np.float32(448.0) if rule == "amax" else 2.0**-8)  # amax 1
        assert s[1, 0] == 1.0 and codes[128].tolist() == [0x7F] * 3


def test_bf16_and_fp32_masters_of_the_same_values_quantize_alike() -> None:
    w = torch.randn(200, 150).to(torch.bfloat16)
    a, sa = quantize_fp8_block(w)
    b, sb = quantize_fp8_block(w.float())
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)


def test_dequantizing_follows_the_documented_rule() -> None:
    w = np.random.default_rng(3).standard_normal((140, 300)).astype(np.float32)
    q, s = check(w, "ue8m0")
    codes, scales = reference(w, "ue8m0")
    values = np.array([_code_value(int(c)) for c in codes.flat], np.float32).reshape(codes.shape)
    expected = values * np.repeat(np.repeat(scales, BLOCK, 0), BLOCK, 1)[: w.shape[0], : w.shape[1]]
    np.testing.assert_array_equal(dequantize_fp8_block(q, s).numpy(), expected)
    assert np.abs(expected - w).max() <= np.abs(w).max() / 16  # 3 mantissa bits: within 2**-4 of amax


def test_other_dimensions_are_refused() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_block(torch.ones(3))


def test_the_fp8_view_quantizes_linear_weights_and_leaves_the_rest_bf16() -> None:
    state = {
        "model.embed_tokens.weight": torch.randn(300, 64),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(64),
        "model.layers.0.input_layernorm.weight": torch.randn(64),
        "model.layers.0.mlp.fc1.weight": torch.randn(200, 64),
        "model.layers.0.mlp.steps": torch.arange(3),
        "lm_head.weight": torch.randn(300, 64),
    }
    view = rollout_view(state, fp8_view("ue8m0"))
    assert {n: t.dtype for n, t in view.items()} == {
        "model.embed_tokens.weight": torch.bfloat16,
        "model.layers.0.self_attn.q_proj.weight": torch.float8_e4m3fn,
        "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.float32,
        "model.layers.0.self_attn.q_proj.bias": torch.bfloat16,
        "model.layers.0.input_layernorm.weight": torch.bfloat16,
        "model.layers.0.mlp.fc1.weight": torch.float8_e4m3fn,
        "model.layers.0.mlp.fc1.weight_scale_inv": torch.float32,
        "model.layers.0.mlp.steps": torch.int64,
        "lm_head.weight": torch.bfloat16,
    }
    assert list(view).index("model.layers.0.mlp.fc1.weight_scale_inv") == 6  # right after its weight
    q, s = quantize_fp8_block(state["model.layers.0.mlp.fc1.weight"], "ue8m0")
    assert torch.equal(view["model.layers.0.mlp.fc1.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(view["model.layers.0.mlp.fc1.weight_scale_inv"], s) and s.shape == (2, 1)
    again = rollout_view(view, fp8_view("ue8m0"))  # the served tensors are their own view
    assert all(torch.equal(again[n].view(torch.uint8), t.view(torch.uint8)) for n, t in view.items())
    plain = {"a.weight": torch.ones(2, 2)}
    assert quantize_state(plain, ViewSpec()) is plain


def test_the_config_says_the_view_is_fp8() -> None:
    config = json.dumps({"dtype": "float32", "architectures": ["LlamaForCausalLM"]}).encode()
    described = json.loads(describe_view({"config.json": config}, fp8_view())["config.json"])
    assert described["dtype"] == "bfloat16"
    assert described["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert "quantization_config" not in json.loads(
        describe_view({"config.json": config}, ViewSpec())["config.json"]
    )


FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 140),
    cols=st.integers(1, 12),
    magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
    specials=st.lists(st.tuples(st.integers(0, 139), st.integers(0, 11), FLOATS), max_size=6),
    rule=st.sampled_from(["amax", "ue8m0"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_the_reference_everywhere(
    rows: int, cols: int, magnitude: float, specials: list[tuple[int, int, float]], rule: ScaleRule, seed: int
) -> None:
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * magnitude).astype(np.float32)
    for r, c, v in specials:
        w[r % rows, c % cols] = v
    check(w, rule)


class _Unwalkable(dict[str, torch.Tensor]):
    """A state whose tensors cannot be listed: a walk over it fails the test."""

    def items(self) -> NoReturn:
        raise AssertionError("the state was walked")


def test_a_spec_without_fp8_rules_leaves_the_state_unwalked() -> None:
    """Each publish calls this on the trainer's thread: without an FP8 block rule there is
    nothing to quantize, whatever the number of tensors, and the state is the answer."""
    state = _Unwalkable(w=torch.ones(4, 4))
    spec = ViewSpec(rules=(ViewRule(pattern="w", dtype="fp32"),))
    assert quantize_state(state, spec) is state
    fp8 = ViewSpec(rules=(ViewRule(pattern="w", dtype=FP8_BLOCK),))
    with pytest.raises(AssertionError, match="walked"):
        quantize_state(state, fp8)
