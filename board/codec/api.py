"""encode / apply / decode: the codec's public operations on raw tensor bytes.

Every delta patch is positions (by one of three codings) followed by the same ULP-step
coding of the values (`deltaboard.board.codec.values`). `encode_changes` builds the candidates that
can pay off for the changed fraction and keeps the smallest: `context` (positions ranked
within classes of the old exponent) for floating tensors when the old tensor or a
`ContextHint` is at hand and the classes' estimated entropy is at most
`context.CONTEXT_GAIN` of the plain one, else `sparse` (gaps); `dense` (bitmap) above 1/8
changed when the positions cost more than a bitmap; whole-tensor `replace` above 1/4
changed when the old bytes are at hand and the deltas cost more than half the tensor.

Context and the device path: ULP steps only use the *old bits at the changed positions*,
which `Changes.old_bits` already carries. The `context` encoding also needs each changed
element's rank within its class of the old tensor: `ranked.context_hint` computes it from
the old bytes (one pass, `deltaboard.board.codec.classes`); the publisher computes the same
`ContextHint` on the tensors' device and passes it instead of `old`. Without either (only
`old_digest`) or with `context=False` it is not tried.

Verification: `apply`/`decode` check the base digest (trusting `old_digest` if given, so the
cost stays O(changed)), then the result digest, updated from the base in O(changed) through
the additive digest; a whole-tensor payload is checked with a full digest.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from deltaboard.board.codec import dense, ranked, replace, sparse
from deltaboard.board.codec.bitio import Reader, Writer
from deltaboard.board.codec.changes import Changes, diff
from deltaboard.board.codec.context import EXPONENT_FIELDS
from deltaboard.board.codec.digest import digest, digest_bits, digest_update, parse_digest
from deltaboard.board.codec.dtypes import as_bits, uint_dtype, width
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.header import PatchHeader, pack, unpack
from deltaboard.board.codec.values import decode_values, encode_values

_DENSE_FROM = 8  # try dense when more than numel / 8 changed
_REPLACE_FROM = 4  # try replacement when more than numel / 4 changed
_POSITIONS: dict[str, Callable[[Reader, int, np.ndarray, str], np.ndarray]] = {
    "sparse": sparse.decode,
    "dense": dense.decode,
}


def read_header(patch: bytes | memoryview) -> PatchHeader:
    """The verified header of a patch (checksum included)."""
    return unpack(patch)[0]


def keyframe(new: np.ndarray, dtype: str) -> bytes:
    bits = as_bits(new, dtype, "new")
    header = PatchHeader(dtype, int(bits.size), "keyframe", None, digest_bits(bits), int(bits.size), 0)
    return pack(header, replace.encode(bits.view(np.uint8), width(dtype)))


def _materialize(old: np.ndarray, changes: Changes) -> np.ndarray:
    new = old.copy()
    new.view(uint_dtype(changes.dtype))[changes.positions] = changes.new_bits
    return new


def encode_changes(
    changes: Changes,
    old: np.ndarray | None,
    dtype: str,
    *,
    old_digest: str | None = None,
    context: bool = True,
    hint: ranked.ContextHint | None = None,
) -> bytes:
    """A patch from `changes` against `old` (whose digest may be given to save a full pass).

    `context=False` skips the `context` encoding: both sides then avoid its pass over the
    old tensor, for larger patches on training data. `hint` (`ranked.ContextHint`,
    computed where the old tensor lives) stands in for that pass, so `old` may then be
    None; it is used as given (`context` is then ignored).
    """
    if changes.dtype != dtype:
        raise PatchError(f"changes are {changes.dtype}, patch asked for {dtype}")
    changes.validate()
    old_bits = None if old is None else as_bits(old, dtype, "old")
    if old_bits is not None and old_bits.size != changes.numel:
        raise PatchError(f"old has {old_bits.size} elements, changes say {changes.numel}")
    if old_digest is None:
        if old is None:
            raise PatchError("encode_changes needs old or old_digest for the base digest")
        old_digest = digest(old, dtype)
    parse_digest(old_digest)
    n, numel = changes.count, changes.numel
    values = Writer()
    encode_values(values, changes.old_bits, changes.new_bits, dtype)
    tail = values.getvalue()
    candidates: list[tuple[str, bytes]] = []

    def positions_by(name: str, write: Callable[[Writer], None]) -> None:
        w = Writer()
        write(w)
        candidates.append((name, w.getvalue() + tail))

    if hint is None and context and old_bits is not None and n and dtype in EXPONENT_FIELDS:
        hint = ranked.context_hint(changes, old_bits)
    if hint is not None and n:
        chosen = hint
        positions_by("context", lambda w: ranked.encode(w, changes, chosen))
    if not candidates:  # the entropy estimate is reliable enough to skip sparse when context wins
        positions_by("sparse", lambda w: sparse.encode(w, changes))
    # a bitmap costs numel / 8 bytes before zstd: only worth building when positions cost
    # more than a well-compressed one (structured masks compress several-fold)
    if n * _DENSE_FROM > numel and len(candidates[0][1]) - len(tail) > numel // 32:
        positions_by("dense", lambda w: dense.encode(w, changes))
    # a whole tensor costs about half its bytes after zstd: only when the deltas cost more
    if old is not None and n * _REPLACE_FROM > numel and min(len(c[1]) for c in candidates) > old.size // 2:
        candidates.append(("replace", replace.encode(_materialize(old, changes), width(dtype))))
    encoding, payload = min(candidates, key=lambda c: len(c[1]))
    header = PatchHeader(dtype, numel, encoding, old_digest, digest_update(old_digest, changes), n, 0)
    return pack(header, payload)


def encode(
    old: np.ndarray | None,
    new: np.ndarray,
    dtype: str,
    *,
    old_digest: str | None = None,
    context: bool = True,
) -> bytes:
    """A patch turning `old` into `new`; `old=None` gives a keyframe (the whole tensor)."""
    if old is None:
        return keyframe(new, dtype)
    return encode_changes(diff(old, new, dtype), old, dtype, old_digest=old_digest, context=context)


def _check_base(header: PatchHeader, old: np.ndarray | None, old_digest: str | None) -> np.ndarray:
    if old is None:
        raise PatchError(f"a {header.encoding} patch needs the old tensor it was made against")
    bits = as_bits(old, header.dtype, "old")
    if bits.size != header.numel:
        raise PatchError(f"wrong base: old has {bits.size} elements, the patch is for {header.numel}")
    held = old_digest if old_digest is not None else digest_bits(bits)
    if held != header.base_digest:
        raise PatchError(f"wrong base: old tensor digest {held} is not the patch's base {header.base_digest}")
    return bits


def _whole(header: PatchHeader, payload: memoryview, out: np.ndarray | None = None) -> np.ndarray:
    new, got = replace.decode(payload, header.numel, width(header.dtype), out)
    if got != header.result_digest:
        raise PatchError("corrupted patch: result digest mismatch")
    return new


def decode(patch: bytes | memoryview, old: np.ndarray | None, old_digest: str | None = None) -> Changes:
    """The verified changes a patch makes to `old` (all elements for a keyframe)."""
    header, payload = unpack(patch)
    return decode_payload(header, payload, old, old_digest)


def decode_payload(
    header: PatchHeader, payload: memoryview, old: np.ndarray | None, old_digest: str | None = None
) -> Changes:
    """`decode` of a patch whose header `header.unpack` already parsed and checked (a caller
    that reads every header before it decodes hashes each patch once): verified against the
    base and result digests of `header` as `decode` does."""
    if header.encoding == "keyframe":
        new_bits = as_bits(_whole(header, payload), header.dtype)
        old_bits = np.zeros_like(new_bits) if old is None else as_bits(old, header.dtype, "old")
        if old_bits.size != new_bits.size:
            raise PatchError(f"old has {old_bits.size} elements, the keyframe has {new_bits.size}")
        positions = np.arange(new_bits.size, dtype=np.int64)
        return Changes(header.dtype, header.numel, positions, old_bits.copy(), new_bits)
    bits = _check_base(header, old, old_digest)
    assert header.base_digest is not None and old is not None
    if header.encoding == "replace":
        changes = diff(old, _whole(header, payload), header.dtype)
        if changes.count != header.changed:
            raise PatchError("corrupted patch: changed count mismatch")
        return changes
    r = Reader(payload)
    if header.encoding == "context":  # its pass over the old tensor reads the old bits too
        positions, before = ranked.decode(r, header.changed, bits, header.dtype)
    else:
        positions = _POSITIONS[header.encoding](r, header.changed, bits, header.dtype)
        before = bits[positions]
    after = decode_values(r, before, header.dtype)
    r.done()
    decoded = Changes(header.dtype, header.numel, positions, before, after)
    if digest_update(header.base_digest, decoded) != header.result_digest:
        raise PatchError("corrupted patch: result digest mismatch")
    return decoded


def keyframe_into(patch: bytes | memoryview, out: np.ndarray) -> None:
    """A keyframe decoded and verified straight into `out` (the tensor's bytes, contiguous
    1-D uint8: a freshly mapped shard), saving `apply`'s copy; on PatchError `out` holds
    whatever was decoded."""
    header, payload = unpack(patch)
    if header.encoding != "keyframe":
        raise PatchError(f"keyframe_into takes a keyframe, not a {header.encoding} patch")
    if out.dtype != np.uint8 or out.size != header.numel * width(header.dtype) or not out.flags.c_contiguous:
        raise PatchError(f"keyframe_into needs {header.numel * width(header.dtype)} contiguous bytes")
    _whole(header, payload, out)


def apply(old: np.ndarray | None, patch: bytes | memoryview, old_digest: str | None = None) -> np.ndarray:
    """The new tensor bytes, bit-exact, or PatchError. `old` is not modified."""
    header, payload = unpack(patch)
    if header.encoding == "keyframe":
        return _whole(header, payload)
    if header.encoding == "replace":
        _check_base(header, old, old_digest)
        return _whole(header, payload)
    changes = decode_payload(header, payload, old, old_digest)
    assert old is not None
    return _materialize(old, changes)
