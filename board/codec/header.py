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

import itertools
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from deltaboard.board.codec.dtypes import dtype_code, dtype_name
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import kernel

MAGIC = b"DBPT"
FORMAT_VERSION = 1
ENCODINGS: tuple[str, ...] = ("keyframe", "sparse", "dense", "replace", "context")
_FIELDS = struct.Struct("<4sBBBBQQ16s16sQ")
_CHECK = struct.Struct("<Q")
HEADER_SIZE = _FIELDS.size + _CHECK.size
_NO_BASE = bytes(16)
# `_FIELDS` then `_CHECK` as one record: a batch's headers are written as columns
_RECORD = np.dtype(
    [
        ("magic", "S4"),
        ("format", "u1"),
        ("dtype", "u1"),
        ("encoding", "u1"),
        ("flags", "u1"),
        ("numel", "<u8"),
        ("changed", "<u8"),
        ("base", "V16"),
        ("result", "V16"),
        ("size", "<u8"),
        ("check", "<u8"),
    ]
)
assert _RECORD.itemsize == HEADER_SIZE


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
    """`pack` from the header's wire fields (codes, raw digests), one patch: what
    `pack_many` writes for each patch of a batch."""
    fields = _FIELDS.pack(
        MAGIC, FORMAT_VERSION, dtype, encoding, 0, numel, changed, base, result, len(payload)
    )
    check = xxhash.xxh3_64()
    check.update(fields)
    check.update(payload)
    return b"".join((fields, _CHECK.pack(check.intdigest()), payload))


def pack_many(
    dtypes: np.ndarray,
    encodings: np.ndarray,
    numels: np.ndarray,
    changed: np.ndarray,
    bases: bytes,
    results: bytes,
    payloads: np.ndarray,
    ends: np.ndarray,
) -> tuple[bytes, np.ndarray]:
    """`pack_fields` for many patches at once: (the patches end to end, each one's end).

    Patch i has the i-th of each column, its raw digests at `16 * i` of `bases` and
    `results`, and payload `payloads[ends[i - 1]:ends[i]]`. The headers are written as
    columns and every byte is moved by compiled calls; only the checksum is a call per
    patch (xxh3 over the header's fields and the payload, which the check splits: both
    are first staged end to end, so that it is one call over one slice), so a batch of
    thousands of small patches costs about what its bytes cost."""
    count = len(ends)
    sizes = np.diff(ends, prepend=0)
    records = np.zeros(count, dtype=_RECORD)
    records["magic"], records["format"] = MAGIC, FORMAT_VERSION
    records["dtype"], records["encoding"] = dtypes, encodings
    records["numel"], records["changed"], records["size"] = numels, changed, sizes
    records["base"] = np.frombuffer(bases, dtype="V16", count=count)
    records["result"] = np.frombuffer(results, dtype="V16", count=count)
    raw = records.view(np.uint8)
    # each patch's checked bytes (its fields, then its payload) end to end, so that its
    # checksum is one call over one slice
    checked = np.empty(int(ends[-1]) + _FIELDS.size * count if count else 0, dtype=np.uint8)
    _interleave(raw, HEADER_SIZE, _FIELDS.size, payloads, ends, checked)
    view = checked.data
    starts = (np.arange(count + 1) * _FIELDS.size + np.concatenate(([0], ends))).tolist()
    records["check"] = [xxhash.xxh3_64_intdigest(view[a:b]) for a, b in itertools.pairwise(starts)]
    patch_ends = np.cumsum(sizes + HEADER_SIZE)
    out = np.empty(int(patch_ends[-1]) if count else 0, dtype=np.uint8)
    _interleave(raw, HEADER_SIZE, HEADER_SIZE, payloads, ends, out)
    return out.tobytes(), patch_ends


@kernel
def _interleave(
    headers: np.ndarray, stride: int, size: int, payloads: np.ndarray, ends: np.ndarray, out: np.ndarray
) -> None:
    """The first `size` bytes of each header (one every `stride` bytes of `headers`), each
    followed by its payload, into `out`."""
    at = start = 0
    for i in range(ends.size):
        out[at : at + size] = headers[stride * i : stride * i + size]
        at += size
        out[at : at + ends[i] - start] = payloads[start : ends[i]]
        at += ends[i] - start
        start = ends[i]


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
