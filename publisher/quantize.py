"""FP8 e4m3 weights with one fp32 scale per 128x128 block: the layout of Hugging Face
fine-grained FP8 checkpoints (DeepSeek-V3, Qwen3-FP8, ...), computed on the tensors' own
device.

A rollout view in FP8 is a different view with its own deltas, so the quantization must
be a pure function of the master weight: the same master gives the same bytes on every
publish, on CPU and CUDA alike, and a second implementation can reproduce it from this
text. For a 2-D weight `w` of shape (R, C), bit for bit:

1. `x = fp32(w)` (exact for bf16/fp16; fp64 rounds to nearest, ties to even).
2. Blocks are `x[128*i : 128*(i+1), 128*j : 128*(j+1)]`, i < ceil(R/128), j < ceil(C/128);
   the last row and column of blocks are smaller when R or C is not a multiple of 128.
3. `amax[i, j]` = the largest `|x|` over the block's *finite* elements (NaN and +-inf are
   left out of it; 0 when there are none).
4. Scale, fp32, by the rule:
   - `amax`: `s = amax / 448` (fp32 division, round to nearest even); 448 is e4m3fn's
     largest finite value, so the block's largest element maps to +-448.
   - `ue8m0`: the `amax` scale rounded *up* to a power of two (for engines whose kernels
     take UE8M0 scales, DeepSeek's `scale_fmt="ue8m0"`): a scale with any mantissa bit
     set becomes the next power of two; a power of two stays; a subnormal becomes 2**-126.
   A block whose scale is 0 (all zero, or `amax < 448 * 2**-150` so the division
   underflows) gets scale 1.0: its values quantize to (signed) zero either way, and
   dequantizing never divides by zero or makes NaN.
5. `q = e4m3fn(clamp(x / s, -448, 448))`: fp32 division (round to nearest even), clamp,
   then the cast to float8_e4m3fn, round to nearest, ties to even (torch's cast). +inf
   becomes 448 (0x7E) and -inf -448 (0xFE); NaN becomes 0x7F whatever its sign or
   payload; -0.0, and negative values too small for e4m3fn, become -0 (0x80).
6. `weight_scale_inv[i, j] = s` (fp32, shape (ceil(R/128), ceil(C/128))).

Dequantizing is `fp32(q[r, c]) * weight_scale_inv[r // 128, c // 128]`, as Hugging
Face's `FP8Linear` and DeepSeek's `weight_dequant` do: despite its name, the stored
"scale_inv" multiplies. (Hugging Face's own quantizer multiplies by `448 / amax` instead
of dividing by `amax / 448`, which rounds a few values differently and makes NaN scales
for all-zero blocks; the layout and the dequantization are the same.)

On CUDA, with Triton installed, bf16, fp16 and fp32 weights are quantized by one kernel that
reads each block once (`quantize_kernels`); the torch code below is the reference it is
tested against, bit for bit, and the path everywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.board.contract.view_spec import FP8_BLOCK, SCALE_SUFFIX, applying_rule

BLOCK = 128
FP8_MAX = 448.0
# float8_e4m3fn's NaN with the sign bit clear: the one NaN the quantizer writes.
FP8_NAN_BITS = 0x7F
ScaleRule = Literal["amax", "ue8m0"]


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Positive finite fp32 scales rounded up to a power of two, on their bits."""
    bits = s.view(torch.int32)
    exponent = bits & 0x7F800000
    up = torch.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent)
    return up.view(torch.float32)


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.no_grad()
def quantize_fp8_block(
    w: torch.Tensor, rule: ScaleRule = "amax", *, fused: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight of `w`'s shape, fp32 block scales), as the module docstring says.

    `fused`: the Triton kernel (None: on CUDA when Triton is installed; True on CPU tensors
    runs it under Triton's interpreter, which the tests do)."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, not shape {tuple(w.shape)}")
    if fused is None:
        from deltaboard.publisher import fused_diff  # it imports the view, which imports this

        fused = fused_diff.available(w.device)
    if fused and w.dtype in KERNEL_DTYPES:
        return _quantize_fused(w, rule)
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    x = w.detach().to(torch.float32)
    padded = F.pad(x, (0, bc * BLOCK - cols, 0, br * BLOCK - rows)) if rows % BLOCK or cols % BLOCK else x
    blocks = padded.reshape(br, BLOCK, bc, BLOCK)
    finite = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0)
    amax = finite.amax(dim=(1, 3))
    # Divided by a tensor, not the number: torch on CUDA multiplies by a scalar divisor's
    # reciprocal, which rounds some scales differently from the division the text specifies.
    scale = amax / torch.full_like(amax, FP8_MAX)
    scale = torch.where(scale > 0, scale, 1.0)
    if rule == "ue8m0":
        scale = _pow2_ceil(scale)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(br * BLOCK, bc * BLOCK)[:rows, :cols]
    bits = q.view(torch.uint8).masked_fill(torch.isnan(x), FP8_NAN_BITS).contiguous()
    return bits.view(torch.float8_e4m3fn), scale.contiguous()


def _quantize_fused(w: torch.Tensor, rule: ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    from deltaboard.publisher import quantize_kernels

    rows, cols = w.shape
    if w.stride(1) != 1:
        w = w.contiguous()
    q = torch.empty((rows, cols), dtype=torch.uint8, device=w.device)
    scales = torch.empty((-(-rows // BLOCK), -(-cols // BLOCK)), dtype=torch.float32, device=w.device)
    if q.numel():
        quantize_kernels.quantize_block128[scales.shape](
            w, q, scales, rows, cols, w.stride(0), UE8M0=rule == "ue8m0", BLOCK=BLOCK, num_warps=8
        )
    return q.view(torch.float8_e4m3fn), scales


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 values of a block-quantized weight: `fp32(q) * scale_inv` of each element's block."""
    rows, cols = q.shape
    per_element = scale_inv.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.to(torch.float32) * per_element


def quantize_state(
    state: Mapping[str, torch.Tensor], spec: ViewSpec, *, fused: bool | None = None
) -> Mapping[str, torch.Tensor]:
    """`state` with each floating weight an FP8 block rule of `spec` serves replaced by its
    FP8 bytes, followed at once by its `_scale_inv`; every other tensor passes through
    untouched (and `state` itself when no rule quantizes anything). `fused` as
    `quantize_fp8_block` takes it."""
    if all(rule.dtype != FP8_BLOCK for rule in spec.rules):
        return state  # runs on the trainer's thread each publish: no walk of 20,000 names for nothing
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        floating = tensor.is_floating_point() and tensor.element_size() > 1  # fp8 passes through
        rule = applying_rule(name, tensor.shape, spec) if floating else None
        if rule is None or rule.dtype != FP8_BLOCK:
            out[name] = tensor
        else:
            out[name], out[name + SCALE_SUFFIX] = quantize_fp8_block(tensor, rule.scale, fused=fused)
    return out if len(out) > len(state) else state
