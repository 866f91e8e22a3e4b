"""zstd with bounded output, and the byte-plane shuffle used for whole tensors.

Decompression never trusts the frame's declared content size: it reads into a buffer of
the size the header allows and then asks for one byte more, so a hostile frame cannot make
the decoder allocate more than the declared tensor (nor a hostile header more than its
frame can hold, `decompress_exact`).

A whole tensor's decode (a keyframe: one per tensor of a new node's view) is bound by the
host's cores, so it makes no copy it can avoid: zstd decompresses straight into a buffer
(zstandard releases the GIL while it runs), and the byte planes are interleaved back by a
compiled loop (GIL released too) straight into the destination, which may be the mapped
shard itself; a 1-byte dtype has no planes and is decompressed into the destination.
Threads decoding several tensors therefore run on every core.
"""

from __future__ import annotations

import numpy as np
import zstandard

from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import kernel
from deltaboard.board.codec.parallel import map_ranges

LEVEL = 3
_MAX_RATIO = (128 << 10) // 4  # bytes out per byte in, at most


def compress(data: bytes | memoryview, level: int = LEVEL) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def decompress_into(data: bytes | memoryview, out: np.ndarray) -> None:
    """Exactly `out.size` bytes out of one zstd frame into `out` (contiguous 1-D uint8),
    or PatchError (`out` then holds whatever was decoded)."""
    size = int(out.size)
    view = out.data
    got = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            while got < size:
                n = reader.readinto(view[got:])
                if not n:
                    break
                got += n
            more = bool(reader.read(1)) if got == size else False
    except zstandard.ZstdError as exc:
        raise PatchError(f"corrupted patch: zstd: {exc}") from None
    if got != size or more:
        held = "more" if more else str(got)
        raise PatchError(f"corrupted patch: zstd frame holds {held} bytes, expected {size}")


def decompress_exact(data: bytes | memoryview, size: int) -> np.ndarray:
    """Exactly `size` bytes out of one zstd frame (uint8), or PatchError.

    The buffer is allocated before decoding, so a size the frame cannot hold is refused
    first: one that differs from the content size the frame declares (our frames always
    declare it), or one beyond zstd's densest coding (an RLE block: 4 bytes for 128 KiB).
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise PatchError(f"corrupted patch: zstd: {exc}") from None
    if declared not in (-1, size) or size > _MAX_RATIO * memoryview(data).nbytes:
        raise PatchError(f"corrupted patch: the zstd frame cannot hold the {size} bytes expected")
    out = np.empty(size, dtype=np.uint8)
    decompress_into(data, out)
    return out


@kernel
def _interleave(planes: np.ndarray, out: np.ndarray, width: int, start: int, stop: int) -> None:
    """Elements [start, stop) of `out` from the byte planes (plane k: byte k of every element)."""
    n = out.size // width
    if width == 2:  # the common case (16-bit floats), written out so that it vectorises
        for i in range(start, stop):
            out[2 * i] = planes[i]
            out[2 * i + 1] = planes[n + i]
        return
    for i in range(start, stop):
        for k in range(width):
            out[i * width + k] = planes[k * n + i]


@kernel
def _deinterleave(data: np.ndarray, planes: np.ndarray, width: int, start: int, stop: int) -> None:
    """Byte planes of elements [start, stop) of `data` (`_interleave` undone)."""
    n = data.size // width
    if width == 2:
        for i in range(start, stop):
            planes[i] = data[2 * i]
            planes[n + i] = data[2 * i + 1]
        return
    for i in range(start, stop):
        for k in range(width):
            planes[k * n + i] = data[i * width + k]


def shuffle(data: np.ndarray, width: int) -> memoryview:
    """Group byte k of every element together: sign/exponent bytes then compress well."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if width == 1:
        return flat.data
    planes = np.empty_like(flat)
    map_ranges(lambda start, stop: _deinterleave(flat, planes, width, start, stop), flat.size // width)
    return planes.data


def unshuffle_into(planes: np.ndarray, width: int, out: np.ndarray) -> None:
    """The elements whose byte planes are `planes`, written into `out` (both 1-D uint8,
    contiguous, of one size); the elements are split over the codec's threads."""
    map_ranges(lambda start, stop: _interleave(planes, out, width, start, stop), out.size // width)


def decode_shuffled(
    data: bytes | memoryview, width: int, size: int, out: np.ndarray | None = None
) -> np.ndarray:
    """A frame of `size` bytes of shuffled byte planes (`shuffle`, then `compress`) decoded
    into `out` (contiguous 1-D uint8 of `size` bytes) when given, else into a new array."""
    if out is not None and out.size != size:  # the compiled loop does not check bounds
        raise PatchError(f"a destination of {out.size} bytes for a tensor of {size}")
    if width == 1 and out is not None:
        decompress_into(data, out)
        return out
    planes = decompress_exact(data, size)
    if width == 1:
        return planes
    if out is None:
        out = np.empty_like(planes)
    unshuffle_into(planes, width, out)
    return out
