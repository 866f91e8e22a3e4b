"""The additive digest of a tensor's bits.

`digest = (sum_i mixA(i, bits_i) mod 2**64, sum_i mixB(i, bits_i) mod 2**64)`, written as
32 hex characters. Each lane is a sum of independent 64-bit mixes of (position, bits), so:

* changing element i from bits b to b' moves each lane by `mix(i, b') - mix(i, b)`: the
  digest of a patched tensor follows from the digest of its base in O(changed elements)
  (`digest_update`), which is what keeps a follower's verification proportional to the patch;
* a wrong base, a flipped bit or a misplaced element changes both lanes unless two
  independent 64-bit mixes collide at once.

It guards against accidents, not adversaries: blob authenticity is sha256 on the board.
The mixes are multiply/xor-shift finalisers (splitmix/murmur style) on uint64 lanes, which
numpy vectorises; a full pass runs in cache-sized chunks on every core.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from board.codec.changes import Changes
from board.codec.dtypes import as_bits
from board.codec.errors import PatchError
from board.codec.parallel import chunks, map_ranges

_MASK = (1 << 64) - 1
_A1, _A2, _A3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_B1, _B2, _B3 = np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9), np.uint64(0xFF51AFD7ED558CCD)
_S29, _S31, _S32, _S33 = np.uint64(29), np.uint64(31), np.uint64(32), np.uint64(33)
_CHUNK = 1 << 15
_DIGEST_HEX = 32


def _lanes(idx: np.ndarray, bits: np.ndarray) -> tuple[int, int]:
    """Sums of both mixes over aligned uint64 arrays of positions and bit patterns.

    Cache-sized pieces, with one scratch array for the shifts: on patch-sized inputs the
    mixes otherwise stream a dozen fresh temporaries through memory.
    """
    sa = sb = 0
    scratch = np.empty(min(idx.size, _CHUNK), dtype=np.uint64)
    for start, stop in chunks(0, idx.size, _CHUNK):
        i, x, t = idx[start:stop], bits[start:stop], scratch[: stop - start]
        a = i * _A1
        a ^= x
        a *= _A2
        a ^= np.right_shift(a, _S32, out=t)
        a *= _A3
        a ^= np.right_shift(a, _S29, out=t)
        b = x * _B1
        b += i
        b *= _B2
        b ^= np.right_shift(b, _S31, out=t)
        b *= _B3
        b ^= np.right_shift(b, _S33, out=t)
        sa += int(a.sum(dtype=np.uint64))
        sb += int(b.sum(dtype=np.uint64))
    return sa, sb


def _format(a: int, b: int) -> str:
    return f"{a & _MASK:016x}{b & _MASK:016x}"


def parse_digest(value: str) -> tuple[int, int]:
    """The two lanes of a digest string; PatchError if it is not one."""
    if len(value) != _DIGEST_HEX:
        raise PatchError(f"digest must be {_DIGEST_HEX} hex characters, got {len(value)}")
    try:
        return int(value[:16], 16), int(value[16:], 16)
    except ValueError:
        raise PatchError(f"digest {value!r} is not hexadecimal") from None


def digest_bits(bits: np.ndarray) -> str:
    """Digest of an array of element bit patterns (unsigned ints)."""
    n = bits.size
    base = np.arange(min(n, _CHUNK), dtype=np.uint64)

    def part(start: int, stop: int) -> tuple[int, int]:
        sa = sb = 0
        for a, b in chunks(start, stop, _CHUNK):
            idx = base[: b - a] + np.uint64(a)
            la, lb = _lanes(idx, bits[a:b].astype(np.uint64))
            sa += la
            sb += lb
        return sa, sb

    sums = map_ranges(part, n)
    return _format(sum(s[0] for s in sums), sum(s[1] for s in sums))


def digest(data: np.ndarray, dtype: str) -> str:
    """Digest of raw tensor bytes (1-D uint8) of a safetensors dtype."""
    return digest_bits(as_bits(data, dtype))


def digest_update(value: str, changes: Changes) -> str:
    """The digest after `changes`, from the digest before them, in O(changed elements)."""
    a, b = parse_digest(value)
    idx = changes.positions.astype(np.uint64)
    na, nb = _lanes(idx, changes.new_bits.astype(np.uint64))
    oa, ob = _lanes(idx, changes.old_bits.astype(np.uint64))
    return _format(a + na - oa, b + nb - ob)


def state_digest(entries: Iterable[tuple[str, str]]) -> str:
    """One digest for a whole view from its (tensor name, tensor digest) pairs.

    Sorted by name so that it does not depend on iteration order; sha256 because it only
    runs over a few hundred short strings.
    """
    h = hashlib.sha256()
    for name, value in sorted(entries):
        h.update(name.encode())
        h.update(b"\0")
        h.update(value.encode())
        h.update(b"\n")
    return h.hexdigest()
