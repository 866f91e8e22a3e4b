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
* `deltaboard`: `board.codec` patches, per changed tensor. The publisher carries the digest
  of the view it last published and the follower the digest of the view it holds, so the
  digests of the old view are inputs here, as they are in the system.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import zstandard

from board import codec

View = Mapping[str, np.ndarray]
Blobs = dict[str, bytes]


class Encoding(Protocol):
    name: str

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs: ...

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]: ...


def _patched(old: View, updates: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: updates[name] if name in updates else old[name] for name in old}


class Full:
    name = "full"

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs:
        return {name: new[name].tobytes() for name in new}

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(blobs[name], dtype=np.uint8).copy() for name in old}


class Coo32:
    name = "coo32"

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs:
        blobs = {}
        for name in new:
            ch = codec.diff(old[name], new[name], dtypes[name])
            if ch.count:
                blobs[name] = ch.positions.astype("<i4").tobytes() + ch.new_bits.tobytes()
        return blobs

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        updates = {}
        for name, blob in blobs.items():
            w = codec.width(dtypes[name])
            n = len(blob) // (4 + w)
            out = old[name].copy()
            out.view(codec.uint_dtype(dtypes[name]))[np.frombuffer(blob, "<i4", n)] = np.frombuffer(
                blob, codec.uint_dtype(dtypes[name]), n, 4 * n
            )
            updates[name] = out
        return _patched(old, updates)


_PULSE_RECORD = struct.Struct("<IQB")


def _smallest_width(max_value: int) -> int:
    return next(w for w in (1, 2, 4, 8) if max_value < 1 << (8 * w))


class Pulse:
    name = "pulse"

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs:
        parts = []
        for i, name in enumerate(new):
            ch = codec.diff(old[name], new[name], dtypes[name])
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
        cctx = zstandard.ZstdCompressor(level=1)
        return {
            name: cctx.compress(np.bitwise_xor(old[name], new[name]).data)
            for name in new
            if not np.array_equal(old[name], new[name])
        }

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        dctx = zstandard.ZstdDecompressor()
        updates = {
            name: np.bitwise_xor(old[name], np.frombuffer(dctx.decompress(blob), dtype=np.uint8))
            for name, blob in blobs.items()
        }
        return _patched(old, updates)


@dataclass
class Deltaboard:
    """Ours. `digests` holds the old view's per-tensor digests (carried, see module doc)."""

    name: str = "deltaboard"
    digests: dict[str, str] = field(default_factory=dict)

    def encode(self, old: View, new: View, dtypes: Mapping[str, str]) -> Blobs:
        blobs = {}
        for name in new:
            ch = codec.diff(old[name], new[name], dtypes[name])
            if ch.count:
                blobs[name] = codec.encode_changes(ch, old[name], dtypes[name], old_digest=self.digests[name])
        return blobs

    def apply(self, old: View, blobs: Blobs, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        updates = {name: codec.apply(old[name], blob, self.digests[name]) for name, blob in blobs.items()}
        return _patched(old, updates)


ENCODINGS: tuple[str, ...] = ("full", "coo32", "pulse", "xor-zstd", "deltaboard")


def make(name: str) -> Encoding:
    classes: dict[str, type[Encoding]] = {
        "full": Full,
        "coo32": Coo32,
        "pulse": Pulse,
        "xor-zstd": XorZstd,
        "deltaboard": Deltaboard,
    }
    return classes[name]()
