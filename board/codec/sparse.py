"""`sparse`: changed positions as Rice-coded gaps, new bits as ULP steps from the old.

The cost is about log2(1/p) + 1.44 bits per changed element for the positions (p the
changed fraction, the entropy of a memoryless gap) plus about one bit for the step. The
receiver needs only the old bits at the changed positions, so decoding is O(changed).
"""

from __future__ import annotations

import numpy as np

from board.codec.bitio import Reader, Writer, decode_index_set, encode_index_set
from board.codec.changes import Changes
from board.codec.dtypes import uint_dtype, width
from board.codec.values import decode_values, encode_values


def encode(changes: Changes) -> bytes:
    w = Writer()
    encode_index_set(w, changes.positions)
    encode_values(w, changes.old_bits, changes.new_bits, width(changes.dtype))
    return w.getvalue()


def decode(payload: memoryview, dtype: str, changed: int, old_bits: np.ndarray) -> Changes:
    r = Reader(payload)
    positions = decode_index_set(r, changed, old_bits.size)
    before = old_bits[positions]
    after = decode_values(r, before, width(dtype)).astype(uint_dtype(dtype))
    r.done()
    return Changes(dtype, int(old_bits.size), positions, before, after)
