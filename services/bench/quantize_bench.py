"""`bench quantize`: what serving a bf16 view in FP8 costs the trainer per version.

The quantizer runs on the tensors' own device before the snapshot (`publisher.quantize`),
so its time is trainer time. Measured on a model-shaped bf16 view (`publish_bench`'s
Llama-like list of tensors) with the FP8 block rule on every linear weight: the Triton
kernel where it runs and the torch reference, each checked against the other bit for bit
on the measured view, beside the memory floor of one read of the view and one write of the
FP8 codes at the device-copy bandwidth measured in the same run.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

from deltaboard.services.bench.publish_bench import copy_limit, shaped_tensors


def quantize_throughput(view_gb: float, device: str, repeats: int = 5) -> dict[str, Any]:
    """Median milliseconds of `quantize_state` over the view, per path and scale rule."""
    import torch

    from deltaboard.board.contract.view_spec import fp8_view
    from deltaboard.publisher import fused_diff
    from deltaboard.publisher.quantize import ScaleRule, quantize_state

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    g = torch.Generator(device=device).manual_seed(0)
    tensors = shaped_tensors(view_gb, model=True, scale=1 if view_gb >= 1 else 8)
    state = {
        name: (torch.randn(shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
        for name, shape in tensors
    }
    view_bytes = sum(t.numel() * t.element_size() for t in state.values())
    paths = [True, False] if fused_diff.available(device) else [False]
    rows: list[dict[str, Any]] = []
    rules: tuple[ScaleRule, ...] = ("amax", "ue8m0")
    for rule in rules:
        spec = fp8_view(rule)
        results = {}
        for fused in paths:
            run = functools.partial(quantize_state, state, spec, fused=fused)
            results[fused] = dict(run())  # warm-up (and the kernel's compile)
            sync()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                run()
                sync()
                times.append(time.perf_counter() - t0)
            quantized = [n for n, t in results[fused].items() if t.dtype == torch.float8_e4m3fn]
            rows.append(
                {
                    "rule": rule,
                    "path": "fused" if fused else "torch",
                    "ms": 1e3 * statistics.median(times),
                    "quantized_tensors": len(quantized),
                }
            )
        if len(results) == 2:
            same = all(
                torch.equal(results[True][n].view(torch.uint8), results[False][n].view(torch.uint8))
                for n in results[False]
            )
            for row in rows[-2:]:
                row["bit_exact"] = same
    limit = copy_limit(device)
    floor_ms = 1e3 * (view_bytes * 1.5 / 1e9) / limit["copy_gbps"]
    return {
        "device": device,
        "view_gb": view_bytes / 1e9,
        "tensors": len(tensors),
        "copy_gbps": limit["copy_gbps"],
        "floor_ms": floor_ms,
        "results": rows,
    }
