"""The self-describing patch header.

Layout (little-endian, 72 bytes, then the payload):

    magic "DBPT" | format u8 | dtype u8 | encoding u8 | flags u8 | numel u64 | changed u64
    | base digest 16 B (zeros for a keyframe) | result digest 16 B | payload length u64
    | xxh3-64 checksum of everything else (header fields and payload) u64

The checksum tells bit rot and truncation ("corrupted") apart from a follower holding the
wrong base ("wrong base"), which only the base digest can tell; the result digest makes a
decoding that went wrong in any other way fail instead of being applied silently.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from deltaboard.board.codec.dtypes import dtype_code, dtype_name
from deltaboard.board.codec.errors import PatchError

MAGIC = b"DBPT"
FORMAT_VERSION = 1
ENCODINGS: tuple[str, ...] = ("keyframe", "sparse", "dense", "replace", "context")
_FIELDS = struct.Struct("<4sBBBBQQ16s16sQ")
_CHECK = struct.Struct("<Q")
HEADER_SIZE = _FIELDS.size + _CHECK.size
_NO_BASE = bytes(16)


@dataclass(frozen=True)
class PatchHeader:
    """What a patch says about itself; `base_digest` is None for a keyframe."""

    dtype: str
    numel: int
    encoding: str
    base_digest: str | None
    result_digest: str
    changed: int
    payload_size: int


def pack(header: PatchHeader, payload: bytes) -> bytes:
    """Header + payload + checksum, as one patch."""
    base = _NO_BASE if header.base_digest is None else bytes.fromhex(header.base_digest)
    return pack_fields(
        dtype_code(header.dtype),
        ENCODINGS.index(header.encoding),
        header.numel,
        header.changed,
        base,
        bytes.fromhex(header.result_digest),
        payload,
    )


def pack_fields(
    dtype: int,
    encoding: int,
    numel: int,
    changed: int,
    base: bytes,
    result: bytes,
    payload: bytes | memoryview,
) -> bytes:
    """`pack` from the header's wire fields (codes, raw digests): what a batch of patches
    pays per patch, without a `PatchHeader` or a digest string to parse."""
    fields = _FIELDS.pack(
        MAGIC, FORMAT_VERSION, dtype, encoding, 0, numel, changed, base, result, len(payload)
    )
    check = xxhash.xxh3_64()
    check.update(fields)
    check.update(payload)
    return b"".join((fields, _CHECK.pack(check.intdigest()), payload))


def unpack(patch: bytes | memoryview) -> tuple[PatchHeader, memoryview]:
    """Parse and verify a patch's header and checksum; the payload is returned as a view."""
    view = memoryview(patch).cast("B")
    if len(view) < HEADER_SIZE:
        raise PatchError(f"patch is truncated: {len(view)} bytes, a header alone is {HEADER_SIZE}")
    magic, version, dcode, ecode, flags, numel, changed, base, result, size = _FIELDS.unpack_from(view)
    if magic != MAGIC:
        raise PatchError("not a deltaboard patch (bad magic)")
    if version != FORMAT_VERSION:
        raise PatchError(f"unsupported patch format version {version}")
    if size != len(view) - HEADER_SIZE:
        raise PatchError(
            f"patch is truncated or has trailing bytes: payload declared {size}, "
            f"present {len(view) - HEADER_SIZE}"
        )
    check = xxhash.xxh3_64()
    check.update(view[: _FIELDS.size])
    check.update(view[HEADER_SIZE:])
    if _CHECK.unpack_from(view, _FIELDS.size)[0] != check.intdigest():
        raise PatchError("patch is corrupted (checksum mismatch)")
    if ecode >= len(ENCODINGS) or flags:
        raise PatchError(f"corrupted patch: unknown encoding {ecode} or flags {flags}")
    if changed > numel:
        raise PatchError(f"corrupted patch: {changed} changed elements of {numel}")
    encoding = ENCODINGS[ecode]
    header = PatchHeader(
        dtype=dtype_name(dcode),
        numel=numel,
        encoding=encoding,
        base_digest=None if encoding == "keyframe" else base.hex(),
        result_digest=result.hex(),
        changed=changed,
        payload_size=size,
    )
    return header, view[HEADER_SIZE:]
