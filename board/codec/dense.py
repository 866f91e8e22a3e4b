"""`dense`: a bitmap of changed elements (zstd) and ULP steps, for high changed fractions.

Above roughly a third of the elements changed, one bit per element beats gap codes; the
bitmap costs a full pass over numel bits, which is why the encoder only tries it then.
"""

from __future__ import annotations

import numpy as np

from board.codec import zstd
from board.codec.bitio import Reader, Writer
from board.codec.changes import Changes
from board.codec.dtypes import uint_dtype, width
from board.codec.errors import PatchError
from board.codec.values import decode_values, encode_values


def encode(changes: Changes) -> bytes:
    mask = np.zeros(changes.numel, dtype=bool)
    mask[changes.positions] = True
    w = Writer()
    w.section(zstd.compress(np.packbits(mask).tobytes(), level=1))
    encode_values(w, changes.old_bits, changes.new_bits, width(changes.dtype))
    return w.getvalue()


def decode(payload: memoryview, dtype: str, changed: int, old_bits: np.ndarray) -> Changes:
    r = Reader(payload)
    numel = int(old_bits.size)
    packed = zstd.decompress_exact(r.section(), (numel + 7) // 8)
    positions = np.flatnonzero(np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=numel))
    if positions.size != changed:
        raise PatchError(f"corrupted patch: bitmap marks {positions.size} elements, header says {changed}")
    before = old_bits[positions]
    after = decode_values(r, before, width(dtype)).astype(uint_dtype(dtype))
    r.done()
    return Changes(dtype, numel, positions.astype(np.int64), before, after)
