"""The additive digest of a tensor's bits.

`digest = (sum_i mixA(i, bits_i) mod 2**64, sum_i mixB(i, bits_i) mod 2**64)`, written as
32 hex characters. Each lane is a sum of independent 64-bit mixes of (position, bits), so:

* changing element i from bits b to b' moves each lane by `mix(i, b') - mix(i, b)`: the
  digest of a patched tensor follows from the digest of its base in O(changed elements)
  (`digest_update`), which is what keeps a follower's verification proportional to the patch;
* a wrong base, a flipped bit or a misplaced element changes both lanes unless two
  independent 64-bit mixes collide at once.

Because each lane sums over *global* positions, a tensor cut into disjoint parts (slices
that different ranks own) has the digest `combine_digests` of its parts' digests, each
computed over the part's elements at their positions in the whole tensor (`digest_slice`,
and `digest_update` on changes whose positions are global: `slice_positions`).

It guards against accidents, not adversaries: blob authenticity is sha256 on the board.
The mixes are multiply/xor-shift finalisers (splitmix/murmur style) on uint64 lanes, in a
compiled loop that the compiler vectorises; a full pass runs on every core.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
from collections.abc import Iterable, Sequence

import numpy as np

from deltaboard.board.codec.changes import Changes
from deltaboard.board.codec.dtypes import as_bits
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import kernel
from deltaboard.board.codec.parallel import map_ranges

_MASK = (1 << 64) - 1
_A1, _A2, _A3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_B1, _B2, _B3 = np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9), np.uint64(0xFF51AFD7ED558CCD)
_DIGEST_HEX = 32


@kernel
def _mix(i: np.uint64, x: np.uint64) -> tuple[np.uint64, np.uint64]:
    a = ((i * _A1) ^ x) * _A2
    a = (a ^ (a >> np.uint64(32))) * _A3
    a ^= a >> np.uint64(29)
    b = (x * _B1 + i) * _B2
    b = (b ^ (b >> np.uint64(31))) * _B3
    b ^= b >> np.uint64(33)
    return a, b


@kernel
def _range_sums(bits: np.ndarray, start: int, stop: int) -> tuple[np.uint64, np.uint64]:
    """Both lanes' sums (mod 2**64) over elements [start, stop).

    The loop runs over a slice from 0: an index the compiler cannot prove non-negative
    keeps a wrap-around check on every read, which stops it vectorising the loop."""
    sa = sb = np.uint64(0)
    part = bits[start:stop]
    base = np.uint64(start)
    for k in range(part.size):
        a, b = _mix(base + np.uint64(k), np.uint64(part[k]))
        sa += a
        sb += b
    return sa, sb


@kernel
def join_sums(planes: np.ndarray, out: np.ndarray, start: int) -> tuple[np.uint64, np.uint64]:
    """The elements whose byte planes are the rows of `planes` (plane k: byte k of each
    element, 2 to 8 planes) written into `out` (their bytes), and both lanes' sums over
    them at global positions from `start`: a keyframe's interleave and digest in one pass
    over its elements instead of two (`deltaboard.board.codec.zstd.decode_shuffled`).

    As in `_range_sums`, every loop runs from 0 over whole rows, so that it vectorises;
    2- and 4-byte elements are assembled in registers, 8-byte ones (rare) a plane at a time."""
    width, n = planes.shape
    sa = sb = np.uint64(0)
    base = np.uint64(start)
    if width == 2:
        lo, hi, out2 = planes[0], planes[1], out.view(np.uint16)
        for i in range(n):
            x2 = np.uint16(lo[i]) | (np.uint16(hi[i]) << np.uint16(8))
            out2[i] = x2
            a, b = _mix(base + np.uint64(i), np.uint64(x2))
            sa += a
            sb += b
    elif width == 4:
        p0, p1, p2, p3, out4 = planes[0], planes[1], planes[2], planes[3], out.view(np.uint32)
        for i in range(n):
            x4 = (
                np.uint32(p0[i])
                | (np.uint32(p1[i]) << np.uint32(8))
                | (np.uint32(p2[i]) << np.uint32(16))
                | (np.uint32(p3[i]) << np.uint32(24))
            )
            out4[i] = x4
            a, b = _mix(base + np.uint64(i), np.uint64(x4))
            sa += a
            sb += b
    else:
        for k in range(width):
            plane = planes[k]
            for i in range(n):
                out[i * width + k] = plane[i]
        out8 = out.view(np.uint64)
        for i in range(n):
            a, b = _mix(base + np.uint64(i), out8[i])
            sa += a
            sb += b
    return sa, sb


@kernel
def change_sums(positions: np.ndarray, old: np.ndarray, new: np.ndarray) -> tuple[np.uint64, np.uint64]:
    """How both lanes move (mod 2**64) when `old` becomes `new` at `positions`."""
    sa = sb = np.uint64(0)
    for j in range(positions.size):
        i = np.uint64(positions[j])
        na, nb = _mix(i, np.uint64(new[j]))
        oa, ob = _mix(i, np.uint64(old[j]))
        sa += na - oa
        sb += nb - ob
    return sa, sb


@kernel
def _run_sums(
    bits: np.ndarray, run_starts: np.ndarray, run_length: int, first: int, last: int
) -> tuple[np.uint64, np.uint64]:
    """Both lanes' sums over runs [first, last): run r is `bits[r*run_length : (r+1)*run_length]`,
    whose elements sit at global positions `run_starts[r] + k`."""
    sa = sb = np.uint64(0)
    for r in range(first, last):
        start = np.uint64(run_starts[r])
        for k in range(run_length):
            a, b = _mix(start + np.uint64(k), np.uint64(bits[r * run_length + k]))
            sa += a
            sb += b
    return sa, sb


def format_digest(a: int, b: int) -> str:
    """A digest string from its two lanes (taken mod 2**64)."""
    return f"{a & _MASK:016x}{b & _MASK:016x}"


def parse_digest(value: str) -> tuple[int, int]:
    """The two lanes of a digest string; PatchError if it is not one."""
    if len(value) != _DIGEST_HEX:
        raise PatchError(f"digest must be {_DIGEST_HEX} hex characters, got {len(value)}")
    try:
        return int(value[:16], 16), int(value[16:], 16)
    except ValueError:
        raise PatchError(f"digest {value!r} is not hexadecimal") from None


def raw_digests(values: Sequence[str]) -> bytes:
    """Every digest's 16 bytes end to end (its two lanes big-endian, as a patch header
    holds them), parsed in one call for a batch of patches; PatchError if one is not a
    digest."""
    if any(len(value) != _DIGEST_HEX for value in values):
        raise PatchError(f"digests must be {_DIGEST_HEX} hex characters")
    try:
        raw = bytes.fromhex("".join(values))
    except ValueError:
        raise PatchError("a digest is not hexadecimal") from None
    if len(raw) != _DIGEST_HEX // 2 * len(values):  # `fromhex` skips spaces between bytes
        raise PatchError("a digest is not hexadecimal")
    return raw


def digest_of_sums(sums: Iterable[tuple[np.uint64, np.uint64]]) -> str:
    """The digest of disjoint ranges' lanes (each pair the sums of `_mix` over one range)."""
    pairs = list(sums)
    return format_digest(sum(int(s[0]) for s in pairs), sum(int(s[1]) for s in pairs))


def digest_bits(bits: np.ndarray) -> str:
    """Digest of an array of element bit patterns (unsigned ints)."""
    return digest_of_sums(map_ranges(lambda start, stop: _range_sums(bits, start, stop), bits.size))


def digest(data: np.ndarray, dtype: str) -> str:
    """Digest of raw tensor bytes (1-D uint8) of a safetensors dtype."""
    return digest_bits(as_bits(data, dtype))


def _run_starts(offset: Sequence[int], shape: Sequence[int], tensor_shape: Sequence[int]) -> np.ndarray:
    """The global flat position of the first element of each last-dimension run of a box."""
    if len(offset) != len(tensor_shape) or len(shape) != len(tensor_shape):
        raise PatchError(
            f"slice offset {list(offset)} / shape {list(shape)} do not match {list(tensor_shape)}"
        )
    if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offset, shape, tensor_shape, strict=True)):
        raise PatchError(f"slice at {list(offset)} of shape {list(shape)} leaves {list(tensor_shape)}")
    strides = np.cumprod((*tensor_shape[1:], 1)[::-1])[::-1].astype(np.int64)
    starts = np.zeros((), dtype=np.int64)
    for o, n, stride in zip(offset[:-1], shape[:-1], strides[:-1], strict=True):
        starts = (starts[..., None] + (o + np.arange(n, dtype=np.int64)) * stride).reshape(-1)
    return (starts.reshape(-1) + (offset[-1] if offset else 0)).astype(np.uint64)


def slice_positions(
    positions: np.ndarray, offset: Sequence[int], shape: Sequence[int], tensor_shape: Sequence[int]
) -> np.ndarray:
    """Positions within a slice (row-major over the box `offset`, `shape`) as positions in
    the whole tensor (`tensor_shape`, row-major): int64, in the same order."""
    if not shape:
        return positions.astype(np.int64)
    local = np.unravel_index(positions, tuple(shape))
    return np.ravel_multi_index(
        tuple(i + o for i, o in zip(local, offset, strict=True)), tuple(tensor_shape)
    ).astype(np.int64)


def digest_slice(
    data: np.ndarray, dtype: str, offset: Sequence[int], shape: Sequence[int], tensor_shape: Sequence[int]
) -> str:
    """Digest of a slice's bytes (its elements row-major over the box `offset`, `shape` of a
    tensor of `tensor_shape`), each element mixed at its position in the whole tensor.

    The digests of disjoint slices covering a tensor combine (`combine_digests`) into the
    tensor's `digest`. A whole tensor is the slice at offset 0 of its own shape.
    """
    bits = as_bits(data, dtype)
    if math.prod(shape) != bits.size:
        raise PatchError(f"slice of shape {list(shape)} given {bits.size} elements")
    starts = _run_starts(offset, shape, tensor_shape)
    run_length = int(shape[-1]) if shape else 1
    if run_length == 0 or starts.size == 0:
        return format_digest(0, 0)
    parallel_min = max(1, (1 << 18) // run_length)
    sums = map_ranges(
        lambda first, last: _run_sums(bits, starts, run_length, first, last), starts.size, parallel_min
    )
    return digest_of_sums(sums)


def combine_digests(digests: Iterable[str]) -> str:
    """The digest of a tensor from the digests of disjoint slices that cover it, each
    computed at global positions (`digest_slice`): both lanes' sums mod 2**64."""
    lanes = [parse_digest(d) for d in digests]
    return format_digest(sum(a for a, _ in lanes), sum(b for _, b in lanes))


def digest_update(value: str, changes: Changes) -> str:
    """The digest after `changes`, from the digest before them, in O(changed elements)."""
    a, b = parse_digest(value)
    da, db = change_sums(changes.positions, changes.old_bits, changes.new_bits)
    return format_digest(a + int(da), b + int(db))


def state_digest(entries: Iterable[tuple[str, str]]) -> str:
    """One digest for a whole view from its (tensor name, tensor digest) pairs.

    Sorted by name so that it does not depend on iteration order: sha256 of the lines
    `name NUL digest LF`, hashed in one call (a model may have tens of thousands).
    """
    pairs = sorted(entries)
    return _lines_digest([name for name, _ in pairs], [value for _, value in pairs])


def sorted_state_digest(names: Sequence[str], values: Sequence[str]) -> str:
    """`state_digest` of the pairs (names[i], values[i]) whose names are already sorted and
    distinct (a publisher's tensors, sorted once per layout): the order is checked in one
    C-level scan instead of sorting the pairs again, which compares tuples."""
    if len(names) != len(values):
        raise ValueError(f"{len(names)} names and {len(values)} digests")
    if any(map(operator.ge, names, itertools.islice(names, 1, None))):
        raise ValueError("names must be sorted and distinct")
    return _lines_digest(names, values)


def _lines_digest(names: Sequence[str], values: Sequence[str]) -> str:
    """sha256 of the lines `names[i] NUL values[i] LF`."""
    if not names:
        return hashlib.sha256(b"").hexdigest()
    text = "\n".join(map("\0".join, zip(names, values, strict=True)))
    return hashlib.sha256(f"{text}\n".encode()).hexdigest()
