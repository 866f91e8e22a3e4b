"""`HotPatch`: one version's verified changes, in the form an engine stages and scatters.

Tensors are grouped by element width (1, 2, 4 or 8 bytes): within a group, the changed
positions, old bits and new bits of every tensor are concatenated in one array each, so
that staging and the commit's scatter make one pass per width over all tensors, whatever
their number. A tensor's slice of its group follows from the counts before it.

The sidecar hands a patch to an engine process as a file (`write_patch` / `read_patch`):
a safetensors file with three arrays per width (`w2.positions`, `w2.old`, `w2.new`) and
the tensor index in its metadata, tagged with a format version. Bits are stored as
signed integers of their width (safetensors and torch know those everywhere); they are
bit patterns, never numbers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from deltaboard.board import codec

FORMAT = "deltaboard-hot-1"
_SIGNED: dict[int, np.dtype[Any]] = {
    1: np.dtype("<i1"),
    2: np.dtype("<i2"),
    4: np.dtype("<i4"),
    8: np.dtype("<i8"),
}


@dataclass(frozen=True)
class TensorPatch:
    """The changes of one tensor: `positions` int64 (flat element indices, increasing),
    `old_bits` and `new_bits` the element-width unsigned bit patterns there."""

    name: str
    dtype: str
    numel: int
    positions: np.ndarray
    old_bits: np.ndarray
    new_bits: np.ndarray

    @classmethod
    def from_changes(cls, name: str, changes: codec.Changes) -> TensorPatch:
        return cls(name, changes.dtype, changes.numel, changes.positions, changes.old_bits, changes.new_bits)


@dataclass(frozen=True)
class WidthGroup:
    """Every changed tensor of one element width, concatenated in `names` order."""

    width: int
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    numels: np.ndarray  # int64, per tensor
    counts: np.ndarray  # int64, per tensor: changed elements
    positions: np.ndarray  # int64, all tensors
    old_bits: np.ndarray  # uint of `width`, all tensors
    new_bits: np.ndarray

    @property
    def changed(self) -> int:
        return int(self.positions.size)

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.old_bits.nbytes + self.new_bits.nbytes

    def tensors(self) -> Iterator[TensorPatch]:
        ends = np.cumsum(self.counts)
        for i, name in enumerate(self.names):
            a, b = int(ends[i] - self.counts[i]), int(ends[i])
            yield TensorPatch(
                name,
                self.dtypes[i],
                int(self.numels[i]),
                self.positions[a:b],
                self.old_bits[a:b],
                self.new_bits[a:b],
            )


@dataclass(frozen=True)
class HotPatch:
    """The changes that take the view from `base_version` to `version`."""

    base_version: int
    version: int
    groups: tuple[WidthGroup, ...]

    @classmethod
    def from_tensors(cls, base_version: int, version: int, tensors: Iterable[TensorPatch]) -> HotPatch:
        by_width: dict[int, list[TensorPatch]] = {}
        for t in tensors:
            if t.positions.size:
                by_width.setdefault(codec.width(t.dtype), []).append(t)
        groups = []
        for w, ts in sorted(by_width.items()):
            bits = codec.uint_dtype(ts[0].dtype)
            groups.append(
                WidthGroup(
                    width=w,
                    names=tuple(t.name for t in ts),
                    dtypes=tuple(t.dtype for t in ts),
                    numels=np.array([t.numel for t in ts], dtype=np.int64),
                    counts=np.array([t.positions.size for t in ts], dtype=np.int64),
                    positions=np.concatenate([t.positions for t in ts]).astype(np.int64, copy=False),
                    old_bits=np.concatenate([t.old_bits for t in ts]).astype(bits, copy=False),
                    new_bits=np.concatenate([t.new_bits for t in ts]).astype(bits, copy=False),
                )
            )
        return cls(base_version, version, tuple(groups))

    @property
    def changed(self) -> int:
        return sum(g.changed for g in self.groups)

    @property
    def nbytes(self) -> int:
        """Bytes the staged arrays take (positions, old and new bits)."""
        return sum(g.nbytes for g in self.groups)

    def tensors(self) -> Iterator[TensorPatch]:
        for g in self.groups:
            yield from g.tensors()


def write_patch(patch: HotPatch, path: Path) -> None:
    """Write `patch` to `path` (replaced atomically: a reader sees all of it or none)."""
    arrays: dict[str, np.ndarray] = {}
    index = []
    for g in patch.groups:
        arrays[f"w{g.width}.positions"] = g.positions
        arrays[f"w{g.width}.old"] = g.old_bits.view(_SIGNED[g.width])
        arrays[f"w{g.width}.new"] = g.new_bits.view(_SIGNED[g.width])
        index.append(
            {
                "width": g.width,
                "names": list(g.names),
                "dtypes": list(g.dtypes),
                "numels": g.numels.tolist(),
                "counts": g.counts.tolist(),
            }
        )
    metadata = {
        "format": FORMAT,
        "base_version": str(patch.base_version),
        "version": str(patch.version),
        "groups": json.dumps(index),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(arrays, str(tmp), metadata=metadata)
    tmp.replace(path)


def read_patch(path: Path) -> HotPatch:
    """Read a patch written by `write_patch`; ValueError if it is not one or is inconsistent."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} patch (format {metadata.get('format')!r})")
    arrays = load_file(str(path))
    groups = []
    for entry in json.loads(metadata["groups"]):
        w = int(entry["width"])
        if w not in _SIGNED:
            raise ValueError(f"{path}: unsupported element width {w}")
        counts = np.array(entry["counts"], dtype=np.int64)
        positions = arrays[f"w{w}.positions"]
        old, new = arrays[f"w{w}.old"], arrays[f"w{w}.new"]
        n = int(counts.sum())
        if positions.dtype != np.int64 or not (positions.size == old.size == new.size == n):
            raise ValueError(f"{path}: width {w} arrays do not match their index")
        names = tuple(entry["names"])
        if not (len(names) == len(entry["dtypes"]) == len(entry["numels"]) == counts.size):
            raise ValueError(f"{path}: width {w} index lists differ in length")
        uint = codec.uint_dtype(entry["dtypes"][0]) if names else _SIGNED[w]
        groups.append(
            WidthGroup(
                width=w,
                names=names,
                dtypes=tuple(entry["dtypes"]),
                numels=np.array(entry["numels"], dtype=np.int64),
                counts=counts,
                positions=positions,
                old_bits=old.view(uint),
                new_bits=new.view(uint),
            )
        )
    return HotPatch(int(metadata["base_version"]), int(metadata["version"]), tuple(groups))
