"""The fused pass against the torch reference at full size, on a GPU (skipped without one).

The interpreter tests (`test_fused_diff.py`) cover the logic on small tensors; here the
compiled kernels run over views of hundreds of MB: a model-shaped list of tensors (large
matrices beside small norms, sizes not multiples of a tile), and every floating dtype the
view supports (and int64) at 64M elements beside ragged small ones, with changes that favour
small weights so that the context classes pay off and ranks are computed.
"""

from __future__ import annotations

import pytest
import torch

from deltaboard.board.contract.schemas import ViewRule, ViewSpec
from deltaboard.services.bench.publish_bench import shaped_tensors
from tests.publisher.test_fused_diff import both

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
RAW = ViewSpec(rules=(ViewRule(pattern="*", dtype="raw"),))


def _moved(t: torch.Tensor, rate: float, g: torch.Generator) -> torch.Tensor:
    """`t` with about `rate` of its elements moved by one step of their bit pattern, small
    weights ten times as often (an AdamW step's pattern)."""
    bits = t.clone().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    small = t.float().abs() < 0.01 if t.is_floating_point() else torch.zeros_like(bits, dtype=torch.bool)
    p = torch.where(small, 10 * rate, rate)
    bits += (torch.rand(t.shape, generator=g, device=t.device) < p).to(bits.dtype)
    return bits.view(t.dtype)


@pytest.mark.parametrize("hints", [False, True])
def test_model_shaped_view_matches_torch(hints):
    g = torch.Generator(device="cuda").manual_seed(0)
    old = {
        name: (torch.randn(shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        for name, shape in shaped_tensors(1.0, model=True, scale=2)
    }
    new = {name: _moved(t, 0.004, g) for name, t in old.items()}
    both(old, new, ViewSpec(), hints)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int64]
)
def test_every_dtype_at_size_matches_torch(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    sizes = [(1 << 26) + 12345, 4097, 1, 0, (1 << 24) - 3]
    old: dict[str, torch.Tensor] = {}
    for i, n in enumerate(sizes):
        if dtype == torch.int64:
            old[f"t{i}"] = torch.randint(-100, 100, (n,), generator=g, device="cuda")
        else:
            old[f"t{i}"] = (torch.randn(n, generator=g, device="cuda") * 0.02).to(dtype)
    new = {name: _moved(t, 0.01, g) for name, t in old.items()}
    both(old, new, RAW, hints=True)
