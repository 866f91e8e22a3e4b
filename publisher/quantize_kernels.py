"""The Triton kernel of `quantize.quantize_fp8_block`: one program per 128x128 block reads
the block once, takes its scale and writes its FP8 codes, so that quantizing a view costs
one read of the weights and one write of a quarter (bf16) of their bytes.

It gives the torch reference's bits exactly: the scale is the same correctly rounded fp32
division, the quotient too (`div_rn`, where Triton's `/` is approximate on CUDA), and the
fp32 -> float8_e4m3fn conversion is written out on the integer bits (round to nearest, ties
to even), so that the result does not depend on which conversion instruction a GPU or
Triton's CPU interpreter offers.
"""

# mypy: ignore-errors

import triton
import triton.language as tl


@triton.jit
def _e4m3_bits(y):
    """float8_e4m3fn bits (as int32) of fp32 `y` with |y| <= 448 (finite; NaN is handled by
    the caller): round to nearest even on the magnitude's bits, sign kept (-0 gives 0x80)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal (|y| >= 2**-6): drop 20 of the 23 mantissa bits with the round-half-even bias,
    # then move the exponent from fp32's bias (127) to e4m3's (7).
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal: the code is |y| * 2**9 rounded half-even; with the implicit bit, that is the
    # 24-bit significand shifted right by 14 - exponent (a shift of 25 or more leaves 0).
    exponent = (mag >> 23) - 127
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - exponent, 31)
    kept = significand >> shift
    rest = significand - (kept << shift)
    half = (1 << (shift - 1)).to(tl.int32)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    sub = tl.where(shift >= 25, 0, kept + up.to(tl.int32))
    code = tl.where(mag >= 0x3C800000, normal, tl.where(mag == 0, 0, sub))  # 0x3C800000: 2**-6
    return sign | code


@triton.jit
def quantize_block128(
    w, q, scales, rows, cols, stride, UE8M0: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    br = tl.program_id(0)
    bc = tl.program_id(1)
    r = br * BLOCK + tl.arange(0, BLOCK)
    c = bc * BLOCK + tl.arange(0, BLOCK)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    offsets = r[:, None].to(tl.int64) * stride + c[None, :]
    x = tl.load(w + offsets, mask=inside, other=0.0).to(tl.float32)
    nan = x != x
    finite = tl.where(nan | (tl.abs(x) == float("inf")), 0.0, tl.abs(x))
    scale = tl.math.div_rn(tl.max(tl.max(finite, axis=1), axis=0), 448.0)
    scale = tl.where(scale > 0, scale, 1.0)
    if UE8M0:  # rounded up to a power of two, on the bits (`quantize._pow2_ceil`)
        sbits = scale.to(tl.int32, bitcast=True)
        exponent = sbits & 0x7F800000
        sbits = tl.where((sbits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent)
        scale = sbits.to(tl.float32, bitcast=True)
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    code = tl.where(nan, 0x7F, _e4m3_bits(tl.where(nan, 0.0, y)))
    tl.store(q + r[:, None].to(tl.int64) * cols + c[None, :], code.to(tl.uint8), mask=inside)
    tl.store(scales + br * tl.cdiv(cols, BLOCK) + bc, scale)
