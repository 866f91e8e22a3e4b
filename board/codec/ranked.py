"""`context` positions: ranks within classes of the old exponent.

The receiver holds the old tensor, so it splits it into the classes of
`board.codec.context` itself; the patch carries the two thresholds, then per class the
Rice-coded gaps between the ranks of its changed elements. It costs one pass over the old
tensor on both sides, which is why the encoder only picks it when the classes save enough.
"""

from __future__ import annotations

import numpy as np

from board.codec.bitio import Reader, Writer, decode_index_set, encode_index_set
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
    for c in range(3):
        mine = ranks[cls == c]
        w.u64(mine.size)
        encode_index_set(w, np.sort(mine))


def decode(r: Reader, changed: int, old_bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype not in EXPONENT_FIELDS:
        raise PatchError(f"corrupted patch: context encoding for {dtype}")
    t_low, t_top = r.u64(), r.u64()
    if not t_low <= t_top <= EXPONENT_FIELDS[dtype][1] + 1:
        raise PatchError(f"corrupted patch: exponent classes {t_low}, {t_top}")
    classes = split_classes(old_bits, dtype, t_low, t_top)
    ranks, labels = [], []
    for c, size in enumerate(classes.sizes):
        count = r.u64()
        if count > size:
            raise PatchError("corrupted patch: more changes than elements in a class")
        ranks.append(decode_index_set(r, count, size))
        labels.append(np.full(count, c, dtype=np.int64))
    if sum(x.size for x in ranks) != changed:
        raise PatchError("corrupted patch: class counts do not add up to the changed count")
    positions = class_positions(classes, np.concatenate(ranks), np.concatenate(labels))
    return np.sort(positions, kind="stable")
