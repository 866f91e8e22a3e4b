"""Sharded state as the trainer holds it: each rank's slice of every tensor, found without
a collective.

Under FSDP2 every parameter is a `DTensor` sharded along dim 0 across the data-parallel
ranks; under a tensor-parallel plan linear weights are `Shard(0)` (colwise) or `Shard(1)`
(rowwise) and the rest `Replicate()`. A `DTensor`'s local tensor is a box of the whole
tensor (an index range per dimension, `compute_local_shape_and_global_offset`), so the
rank publishes that box as one part (docs/contract.md, "Parts") and never gathers the
tensor. A box that several ranks hold alike (a `Replicate()` mesh dimension) is published
by the rank at coordinate 0 of every such dimension only. Plain local tensors may declare
their box (`LocalSlice`) the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from deltaboard.publisher.ranks import LocalSlice

Declared = Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]
"""`{name: (whole tensor's shape, offset of the local tensor in it)}` for plain local tensors."""


def dtensor_slice(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box (shape, offset) of the whole tensor this rank publishes, or None when another
    rank publishes the same box (this one is not at coordinate 0 of a replicated mesh
    dimension)."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return None
    for dim, placement in enumerate(tensor.placements):
        if not isinstance(placement, Shard | Replicate):
            raise ValueError(f"cannot publish a DTensor placed {placement}: only Shard(d) and Replicate()")
        if isinstance(placement, Replicate) and coordinate[dim] != 0:
            return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(int(n) for n in shape), tuple(int(o) for o in offset)


def local_shards(
    state: Mapping[str, torch.Tensor], declared: Declared, rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, LocalSlice]]:
    """This rank's tensors of `state` and where each sits in its whole tensor.

    DTensors become their local tensors (`to_local()`: no communication); a tensor of a
    `declared` name is a slice of that shape at that offset; other plain tensors are taken
    as replicated and published whole by rank 0. Empty slices (uneven shards leave some
    ranks nothing) are left out.
    """
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, LocalSlice] = {}
    for order, (name, tensor) in enumerate(state.items()):
        if isinstance(tensor, DTensor):
            box = dtensor_slice(tensor)
            if box is None:
                continue
            local = tensor.to_local()
            if tuple(local.shape) != box[0]:
                raise ValueError(
                    f"{name}: local tensor {list(local.shape)} is not its placement's {list(box[0])}"
                )
            whole, offset = tuple(tensor.shape), box[1]
        elif name in declared:
            local = tensor
            whole, offset = declared[name]
        elif rank == 0:
            local, whole, offset = tensor, tuple(tensor.shape), (0,) * tensor.dim()
        else:
            continue
        if local.numel() == 0 and math.prod(whole) != 0:
            continue
        tensors[name] = local.detach()
        slices[name] = LocalSlice(whole, offset, order)
    return tensors, slices
