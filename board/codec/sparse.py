"""`sparse` positions: Rice-coded gaps between changed positions.

About log2(1/p) + 1.44 bits per changed element (p the changed fraction), the entropy of a
memoryless gap. Decoding is O(changed): the old tensor is not read.
"""

from __future__ import annotations

import numpy as np

from deltaboard.board.codec.bitio import Reader, Writer, decode_index_sets, encode_index_sets
from deltaboard.board.codec.changes import Changes


def encode(w: Writer, changes: Changes) -> None:
    encode_index_sets(w, [changes.positions])


def decode(r: Reader, changed: int, old_bits: np.ndarray, dtype: str) -> np.ndarray:
    return decode_index_sets(r, [changed], [old_bits.size])[0]
