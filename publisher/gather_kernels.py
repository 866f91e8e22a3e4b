"""The Triton kernel of `device_gather`: many tensors' bits copied into one buffer by
their addresses, in one launch (imported only where Triton is)."""

# mypy: ignore-errors

import triton
import triton.language as tl


@triton.jit
def gather_bits(addresses, numel, offsets, block_slot, block_start, out, BLOCK: tl.constexpr):
    """Block b copies elements [block_start[b], + BLOCK) of tensor i = block_slot[b], read
    at the address `addresses[i]` (0: not this kernel's to copy), to `out[offsets[i]:]`,
    as `out`'s integer type: bits, never values."""
    b = tl.program_id(0)
    i = tl.load(block_slot + b)
    address = tl.load(addresses + i)
    if address != 0:
        source = address.to(out.dtype)  # a pointer of out's element type
        k = tl.load(block_start + b) + tl.arange(0, BLOCK)
        inside = k < tl.load(numel + i)
        tl.store(out + tl.load(offsets + i) + k, tl.load(source + k, mask=inside), mask=inside)
