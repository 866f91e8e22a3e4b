"""zstd with bounded output, and the byte-plane shuffle used for whole tensors.

Decompression never trusts the frame's declared content size: it reads in bounded pieces
and stops one byte past the size the header allows, so a hostile frame cannot make the
decoder allocate more than the declared tensor.
"""

from __future__ import annotations

import numpy as np
import zstandard

from deltaboard.board.codec.errors import PatchError

LEVEL = 3
_PIECE = 1 << 24


def compress(data: bytes | memoryview, level: int = LEVEL) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def decompress_exact(data: bytes | memoryview, size: int) -> bytes:
    """Exactly `size` bytes out of one zstd frame, or PatchError."""
    pieces: list[bytes] = []
    got = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(bytes(data)) as reader:
            while got <= size:
                piece = reader.read(min(_PIECE, size + 1 - got))
                if not piece:
                    break
                pieces.append(piece)
                got += len(piece)
    except zstandard.ZstdError as exc:
        raise PatchError(f"corrupted patch: zstd: {exc}") from None
    if got != size:
        held = "more" if got > size else str(got)
        raise PatchError(f"corrupted patch: zstd frame holds {held} bytes, expected {size}")
    return b"".join(pieces)


def shuffle(data: np.ndarray, width: int) -> bytes:
    """Group byte k of every element together: sign/exponent bytes then compress well."""
    if width == 1:
        return data.tobytes()
    return np.ascontiguousarray(data.reshape(-1, width).T).tobytes()


def unshuffle(data: bytes, width: int) -> np.ndarray:
    planes = np.frombuffer(data, dtype=np.uint8)
    if width == 1:
        return planes.copy()
    return np.ascontiguousarray(planes.reshape(width, -1).T).reshape(-1)
