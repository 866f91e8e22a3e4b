"""`dense` positions: a bitmap of changed elements, zstd-compressed.

Above roughly a third of the elements changed, one bit per element beats gap codes; the
bitmap costs a full pass over numel bits, which is why the encoder only tries it then.
"""

from __future__ import annotations

import numpy as np

from deltaboard.board.codec import zstd
from deltaboard.board.codec.bitio import Reader, Writer
from deltaboard.board.codec.changes import Changes
from deltaboard.board.codec.errors import PatchError


def encode(w: Writer, changes: Changes) -> None:
    mask = np.zeros(changes.numel, dtype=bool)
    mask[changes.positions] = True
    w.section(zstd.compress(np.packbits(mask).tobytes(), level=1))


def decode(r: Reader, changed: int, old_bits: np.ndarray, dtype: str) -> np.ndarray:
    numel = int(old_bits.size)
    packed = zstd.decompress_exact(r.section(), (numel + 7) // 8)
    positions = np.flatnonzero(np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=numel))
    if positions.size != changed:
        raise PatchError(f"corrupted patch: bitmap marks {positions.size} elements, header says {changed}")
    return positions.astype(np.int64)
