"""The encodings the codec benchmark compares, each with its decoder so exactness is checked.

A view is `{name: raw bytes}` with a dtype per name. Every encoding turns (old view, new
view) into named blobs and back; per-tensor encodings omit unchanged tensors, as a delta
manifest does.

* `full`: the whole new view, raw.
* `coo32`: per changed tensor, a flat int32 index and the new value of each changed element.
* `pulse`: PULSE as published: per tensor, sorted changed indices first-differenced and
  stored in the smallest unsigned width (1/2/4/8 bytes) that holds them, then the
  replacement values (the new bf16 bits); all tensors of the step in one zstd level-1 frame.
* `xor-zstd`: per changed tensor, the whole-tensor XOR of old and new bytes, zstd level 1
  (what stitch and slime ship).
* `deltaboard`: `deltaboard.board.codec` patches, per changed tensor. The publisher carries the digest
  of the view it last published and the follower the digest of the view it holds, so the
  digests of the old view are inputs here, as they are in the system.
* `deltaboard-sparse`: the same without the `context` encoding (no pass over the old
  tensor on either side), to show what the context costs and saves.

Per-tensor work runs on a pool of two threads (the machine's cores) for every encoding
alike; numpy and zstd release the GIL.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
import zstandard

from deltaboard.board import codec

View = Mapping[str, np.ndarray]
Blobs = dict[str, bytes]
T = TypeVar("T")
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench")


def each(names: Iterable[str], fn: Callable[[str], T]) -> dict[str, T]:
    """`fn(name)` for every name on the pool, in order."""
    names = list(names)
    return dict(zip(names, _POOL.map(fn, names), strict=True))


def changed_only(blobs: Mapping[str, bytes | None]) -> Blobs:
    return {name: blob for name, blob in blobs.items() if blob is not None}


class Encoding(Protocol):
    name: str

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs: ...

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]: ...


def _patched(old: View, updates: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: updates[name] if name in updates else old[name] for name in old}


class Full:
    name = "full"

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs:
        return each(new, lambda name: new[name].tobytes())

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        return each(old, lambda name: np.frombuffer(blobs[name], dtype=np.uint8).copy())


class Coo32:
    name = "coo32"

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs:
        def one(name: str) -> bytes | None:
            ch = codec.diff(old[name], new[name], dtypes[name])
            return ch.positions.astype("<i4").tobytes() + ch.new_bits.tobytes() if ch.count else None

        return changed_only(each(new, one))

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        def one(name: str) -> np.ndarray:
            blob, bits = blobs[name], codec.uint_dtype(dtypes[name])
            n = len(blob) // (4 + bits.itemsize)
            out = old[name].copy()
            out.view(bits)[np.frombuffer(blob, "<i4", n)] = np.frombuffer(blob, bits, n, 4 * n)
            return out

        return _patched(old, each(blobs, one))


_PULSE_RECORD = struct.Struct("<IQB")


def _smallest_width(max_value: int) -> int:
    return next(w for w in (1, 2, 4, 8) if max_value < 1 << (8 * w))


class Pulse:
    name = "pulse"

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs:
        diffs = each(new, lambda name: codec.diff(old[name], new[name], dtypes[name]))
        parts = []
        for i, ch in enumerate(diffs.values()):
            if not ch.count:
                continue
            deltas = np.diff(ch.positions, prepend=0)
            w = _smallest_width(int(deltas.max()))
            record = _PULSE_RECORD.pack(i, ch.count, w)
            parts += [record, deltas.astype(f"<u{w}").tobytes(), ch.new_bits.tobytes()]
        return {"": zstandard.ZstdCompressor(level=1).compress(b"".join(parts))}

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(blobs[""])
        names = list(old)
        updates, pos = {}, 0
        while pos < len(raw):
            i, n, w = _PULSE_RECORD.unpack_from(raw, pos)
            pos += _PULSE_RECORD.size
            name = names[i]
            bits = codec.uint_dtype(dtypes[name])
            positions = np.cumsum(np.frombuffer(raw, f"<u{w}", n, pos).astype(np.int64))
            pos += n * w
            values = np.frombuffer(raw, bits, n, pos)
            pos += n * bits.itemsize
            out = old[name].copy()
            out.view(bits)[positions] = values
            updates[name] = out
        return _patched(old, updates)


class XorZstd:
    name = "xor-zstd"

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs:
        def one(name: str) -> bytes | None:
            if np.array_equal(old[name], new[name]):
                return None
            return zstandard.ZstdCompressor(level=1).compress(np.bitwise_xor(old[name], new[name]).data)

        return changed_only(each(new, one))

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        def one(name: str) -> np.ndarray:
            patch = zstandard.ZstdDecompressor().decompress(blobs[name])
            return np.bitwise_xor(old[name], np.frombuffer(patch, dtype=np.uint8))

        return _patched(old, each(blobs, one))


@dataclass
class Deltaboard:
    """Ours. `digests` holds the old view's per-tensor digests (carried, see module doc)."""

    name: str = "deltaboard"
    digests: dict[str, str] = field(default_factory=dict)
    context: bool = True

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs:
        def one(name: str) -> bytes | None:
            ch = codec.diff(old[name], new[name], dtypes[name])
            if not ch.count:
                return None
            return codec.encode_changes(
                ch, old[name], dtypes[name], old_digest=self.digests[name], context=self.context
            )

        return changed_only(each(new, one))

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        return _patched(
            old, each(blobs, lambda name: codec.apply(old[name], blobs[name], self.digests[name]))
        )


ENCODINGS: tuple[str, ...] = ("full", "coo32", "pulse", "xor-zstd", "deltaboard")
VARIANTS: tuple[str, ...] = ("deltaboard-sparse",)


def make(name: str, digests: dict[str, str]) -> Encoding:
    """The encoding of that name; `digests` are the old view's (used by ours)."""
    if name == "deltaboard":
        return Deltaboard(digests=digests)
    if name == "deltaboard-sparse":
        return Deltaboard(name=name, digests=digests, context=False)
    classes: dict[str, type[Encoding]] = {"full": Full, "coo32": Coo32, "pulse": Pulse, "xor-zstd": XorZstd}
    return classes[name]()
