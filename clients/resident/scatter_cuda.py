"""The commit's kernels on CUDA: check, then store, by absolute address (Triton).

The same contract as `scatter.swap` on the host: all or nothing. A first kernel finds the
first element whose memory is not the staged old value; only when there is none does a
second kernel store the new values. One launch per element width covers every tensor,
so a model of twenty thousand tensors costs what its changed elements cost. The one
synchronisation (reading that index) is the only host round trip in the pause.

Triton ships with the CUDA builds of torch; a CUDA resident view without it is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_ELEMENTS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


# `n`, the changed count, differs from version to version: Triton would compile another
# variant of each kernel whenever its divisibility by 16 changed, inside the engine's pause
# (the H200's 8 GB bench: one version in three paused ~150 ms, ~100 ms of it CPU).
@triton.jit(do_not_specialize=["n"])  # type: ignore[untyped-decorator]
def _first_mismatch(addrs, expect, n, first, ELEMENT: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    address = tl.load(addrs + offsets, mask=inside, other=0)
    current = tl.load(address.to(tl.pointer_type(ELEMENT)), mask=inside, other=0)
    wanted = tl.load(expect + offsets, mask=inside, other=0)
    candidates = tl.where(inside & (current != wanted), offsets, n)
    tl.atomic_min(first, tl.min(candidates, axis=0))


@triton.jit(do_not_specialize=["n"])  # type: ignore[untyped-decorator]
def _store(addrs, values, n, ELEMENT: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    address = tl.load(addrs + offsets, mask=inside, other=0)
    tl.store(address.to(tl.pointer_type(ELEMENT)), tl.load(values + offsets, mask=inside), mask=inside)


def swap(addrs: torch.Tensor, expect: torch.Tensor, put: torch.Tensor, width: int) -> int:
    """-1 when every element held `expect` and now holds `put`; else the index of the
    first element that did not, with nothing written."""
    n = addrs.numel()
    if n == 0:
        return -1
    grid: Any = (triton.cdiv(n, _BLOCK),)
    first = torch.full((1,), n, dtype=torch.int64, device=addrs.device)
    _first_mismatch[grid](addrs, expect, n, first, ELEMENT=_ELEMENTS[width], BLOCK=_BLOCK)
    found = int(first.item())
    if found < n:
        return found
    _store[grid](addrs, put, n, ELEMENT=_ELEMENTS[width], BLOCK=_BLOCK)
    return -1


def warm_up(device: torch.device, width: int) -> None:
    """Compile both kernels for one element width (on a scratch element), so that the first
    commit does not pay Triton's compilation inside the engine's pause."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    scratch = torch.zeros(1, dtype=ints, device=device)
    addrs = torch.tensor([scratch.data_ptr()], dtype=torch.int64, device=device)
    swap(addrs, scratch.clone(), scratch.clone(), width)
    torch.cuda.synchronize(device)
