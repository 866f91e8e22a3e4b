"""zstd with bounded output, and the byte-plane shuffle used for whole tensors.

Decompression never trusts the frame's declared content size: it reads into a buffer of
the size the header allows and then asks for one byte more, so a hostile frame cannot make
the decoder allocate more than the declared tensor (nor a hostile header more than its
frame can hold, `decompress_exact`).

A whole tensor's decode (a keyframe: one per tensor of a new node's view) is bound by the
host's cores, so it makes no copy it can avoid: zstd decompresses straight into a buffer
(zstandard releases the GIL while it runs), and the byte planes are interleaved back by a
compiled loop (GIL released too) straight into the destination, which may be the mapped
shard itself, taking the elements' digest in the same loop (the tensor is written and
never read back); a 1-byte dtype has no planes and is decompressed into the destination.
Threads decoding several tensors therefore run on every core.

Parameters (`compress` without a level): on byte planes, what compresses is the order-0
skew of the sign/exponent plane, which zstd codes as Huffman literals; mantissa planes are
noise that zstd stores as raw blocks (copied, not decoded, on the way back). Matches within
the exponent plane are short and code it worse than its literals, and executing them is
most of the decode: so the planes go through zstd's fastest strategy with a 64-entry match
table and 7-byte minimum matches, which leaves nearly all of such a plane to the literals
and still finds the runs of structured tensors (zeros, constants, counters). Any frame
decodes the same way, whatever parameters wrote it: the choice is the encoder's alone
(figures: docs/design.md, section 6).
"""

from __future__ import annotations

import numpy as np
import zstandard

from deltaboard.board.codec.digest import digest_bits, digest_of_sums, join_sums
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import kernel
from deltaboard.board.codec.parallel import map_ranges

_MAX_RATIO = (128 << 10) // 4  # bytes out per byte in, at most
_LITERALS = {"window_log": 19, "hash_log": 6, "chain_log": 6, "search_log": 1, "min_match": 7, "strategy": 1}


def compress(data: bytes | memoryview, level: int | None = None) -> bytes:
    """One zstd frame of `data`: at `level`, or by default with the parameters that favour
    literals (the module docstring says why)."""
    if level is not None:
        return zstandard.ZstdCompressor(level=level).compress(data)
    params = zstandard.ZstdCompressionParameters(**_LITERALS)
    return zstandard.ZstdCompressor(compression_params=params).compress(data)


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
def _split(data: np.ndarray, planes: np.ndarray) -> None:
    """The byte planes of the elements in `data` into the rows of `planes` (`_join` undone)."""
    width, n = planes.shape
    if width == 2:
        lo, hi, data2 = planes[0], planes[1], data.view(np.uint16)
        for i in range(n):
            lo[i] = np.uint8(data2[i] & np.uint16(0xFF))
            hi[i] = np.uint8(data2[i] >> np.uint16(8))
    elif width == 4:
        p0, p1, p2, p3, data4 = planes[0], planes[1], planes[2], planes[3], data.view(np.uint32)
        for i in range(n):
            v = data4[i]
            p0[i] = np.uint8(v & np.uint32(0xFF))
            p1[i] = np.uint8((v >> np.uint32(8)) & np.uint32(0xFF))
            p2[i] = np.uint8((v >> np.uint32(16)) & np.uint32(0xFF))
            p3[i] = np.uint8(v >> np.uint32(24))
    else:
        for k in range(width):
            plane = planes[k]
            for i in range(n):
                plane[i] = data[i * width + k]


def shuffle(data: np.ndarray, width: int) -> memoryview:
    """Group byte k of every element together: sign/exponent bytes then compress well."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if width == 1:
        return flat.data
    planes = np.empty_like(flat).reshape(width, -1)

    map_ranges(
        lambda start, stop: _split(flat[start * width : stop * width], planes[:, start:stop]), planes.shape[1]
    )
    return planes.reshape(-1).data


def decode_shuffled(
    data: bytes | memoryview, width: int, size: int, out: np.ndarray | None = None
) -> tuple[np.ndarray, str]:
    """A frame of `size` bytes of shuffled byte planes (`shuffle`, then `compress`) decoded
    into `out` (contiguous 1-D uint8 of `size` bytes) when given, else into a new array,
    and the digest of its elements (unsigned ints of `width` bytes), taken as the planes
    are interleaved back: one pass over the elements, split over the codec's threads."""
    if out is not None and out.size != size:  # the compiled loop does not check bounds
        raise PatchError(f"a destination of {out.size} bytes for a tensor of {size}")
    if width == 1:
        if out is None:
            out = decompress_exact(data, size)
        else:
            decompress_into(data, out)
        return out, digest_bits(out)
    planes = decompress_exact(data, size)
    if out is None:
        out = np.empty_like(planes)
    rows = planes.reshape(width, -1)
    target = out
    sums = map_ranges(
        lambda start, stop: join_sums(rows[:, start:stop], target[start * width : stop * width], start),
        size // width,
    )
    return out, digest_of_sums(sums)
