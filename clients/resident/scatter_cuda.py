"""The commit's kernels on CUDA: check, then store, by absolute address (Triton).

The same contract as `scatter.swap` on the host: all or nothing. A first kernel counts
the elements whose memory is not the staged old value; only when there are none does a
second kernel store the new values. One launch per element width covers every tensor,
so a model of twenty thousand tensors costs what its changed elements cost. The one
synchronisation (reading the count) is the only host round trip in the pause.

Triton ships with the CUDA builds of torch; a CUDA resident view without it is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_ELEMENTS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit  # type: ignore[untyped-decorator]
def _count_mismatches(addrs, expect, n, bad, ELEMENT: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    address = tl.load(addrs + offsets, mask=inside, other=0)
    current = tl.load(address.to(tl.pointer_type(ELEMENT)), mask=inside, other=0)
    wanted = tl.load(expect + offsets, mask=inside, other=0)
    tl.atomic_add(bad, tl.sum((inside & (current != wanted)).to(tl.int32), axis=0))


@triton.jit  # type: ignore[untyped-decorator]
def _store(addrs, values, n, ELEMENT: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    address = tl.load(addrs + offsets, mask=inside, other=0)
    tl.store(address.to(tl.pointer_type(ELEMENT)), tl.load(values + offsets, mask=inside), mask=inside)


def swap(addrs: torch.Tensor, expect: torch.Tensor, put: torch.Tensor, width: int) -> int:
    """-1 when every element held `expect` and now holds `put`; else 0 (some element did
    not hold `expect`) with nothing written."""
    n = addrs.numel()
    if n == 0:
        return -1
    grid: Any = (triton.cdiv(n, _BLOCK),)
    bad = torch.zeros(1, dtype=torch.int32, device=addrs.device)
    _count_mismatches[grid](addrs, expect, n, bad, ELEMENT=_ELEMENTS[width], BLOCK=_BLOCK)
    if int(bad.item()):
        return 0
    _store[grid](addrs, put, n, ELEMENT=_ELEMENTS[width], BLOCK=_BLOCK)
    return -1
