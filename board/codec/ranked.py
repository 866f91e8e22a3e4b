"""`context` positions: ranks within classes of the old exponent.

The receiver holds the old tensor, so it splits it into the classes of
`board.codec.context` itself; the patch carries the two thresholds, then per class the
Rice-coded gaps between the ranks of its changed elements. It costs one pass over the old
tensor on both sides, which is why the encoder only picks it when the classes save enough.
"""

from __future__ import annotations

import numpy as np

from board.codec.bitio import Reader, Writer, decode_index_sets, encode_index_sets
from board.codec.changes import Changes
from board.codec.classes import class_of, class_positions, class_ranks, split_classes
from board.codec.context import EXPONENT_FIELDS
from board.codec.errors import PatchError


def encode(w: Writer, changes: Changes, old_bits: np.ndarray, t_low: int, t_top: int) -> None:
    classes = split_classes(old_bits, changes.dtype, t_low, t_top)
    cls = class_of(changes.old_bits, changes.dtype, t_low, t_top)
    w.u64(t_low)
    w.u64(t_top)
    ranks = class_ranks(classes, changes.positions, cls)
    per_class = [ranks[cls == c] for c in range(3)]
    for mine in per_class:
        w.u64(mine.size)
    encode_index_sets(w, per_class)


def decode(r: Reader, changed: int, old_bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype not in EXPONENT_FIELDS:
        raise PatchError(f"corrupted patch: context encoding for {dtype}")
    t_low, t_top = r.u64(), r.u64()
    if not t_low <= t_top <= EXPONENT_FIELDS[dtype][1] + 1:
        raise PatchError(f"corrupted patch: exponent classes {t_low}, {t_top}")
    classes = split_classes(old_bits, dtype, t_low, t_top)
    counts = [r.u64() for _ in range(3)]
    if any(count > size for count, size in zip(counts, classes.sizes, strict=True)):
        raise PatchError("corrupted patch: more changes than elements in a class")
    if sum(counts) != changed:
        raise PatchError("corrupted patch: class counts do not add up to the changed count")
    ranks = np.concatenate(decode_index_sets(r, counts, classes.sizes))
    labels = np.repeat(np.arange(3), counts)
    positions = class_positions(classes, ranks, labels)
    return np.sort(positions, kind="stable")
