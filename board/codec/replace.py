"""`replace` and `keyframe`: the whole tensor, byte planes shuffled, zstd-compressed.

A keyframe has no base; a replacement is the same payload used as a delta when so much
changed that coding the changes costs more than the tensor.
"""

from __future__ import annotations

import numpy as np

from deltaboard.board.codec import zstd


def encode(new: np.ndarray, width: int) -> bytes:
    return zstd.compress(zstd.shuffle(new, width))


def decode(
    payload: memoryview, numel: int, width: int, out: np.ndarray | None = None
) -> tuple[np.ndarray, str]:
    """The tensor's bytes (uint8), written into `out` when given (numel * width bytes,
    contiguous: a new node's mapped shard, written once), and their digest."""
    return zstd.decode_shuffled(payload, width, numel * width, out)
