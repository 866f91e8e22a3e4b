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

    def fill(self, positions: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray) -> None:
        """Write a tensor's changes into this slot (views into a patch's group arrays)."""
        if positions.size != self.positions.size:
            raise ValueError(f"{self.name}: {positions.size} changes for a slot of {self.positions.size}")
        self.positions[:] = positions
        self.old_bits[:] = old_bits
        self.new_bits[:] = new_bits


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
        given = list(tensors)
        shapes = [(t.name, t.dtype, t.numel, t.positions.size) for t in given]
        patch = cls.allocate(base_version, version, shapes)
        slots = dict(patch.slots())
        for t in given:
            if t.positions.size:
                slots[t.name].fill(t.positions, t.old_bits, t.new_bits)
        return patch

    @classmethod
    def allocate(
        cls, base_version: int, version: int, shapes: Iterable[tuple[str, str, int, int]]
    ) -> HotPatch:
        """A patch of uninitialised arrays for tensors (name, dtype, numel, changed), in that
        order within each width, to be filled through `slots`: a decoder that knows each
        tensor's changed count up front (a patch header says it) writes each tensor's
        changes straight into its place, from its own thread, instead of a concatenation
        of every tensor's arrays afterwards."""
        by_width: dict[int, list[tuple[str, str, int, int]]] = {}
        for shape in shapes:
            if shape[3]:
                by_width.setdefault(codec.width(shape[1]), []).append(shape)
        groups = []
        for w, ts in sorted(by_width.items()):
            n = sum(t[3] for t in ts)
            groups.append(
                WidthGroup(
                    width=w,
                    names=tuple(t[0] for t in ts),
                    dtypes=tuple(t[1] for t in ts),
                    numels=np.array([t[2] for t in ts], dtype=np.int64),
                    counts=np.array([t[3] for t in ts], dtype=np.int64),
                    positions=np.empty(n, dtype=np.int64),
                    old_bits=np.empty(n, dtype=codec.uint_dtype(ts[0][1])),
                    new_bits=np.empty(n, dtype=codec.uint_dtype(ts[0][1])),
                )
            )
        return cls(base_version, version, tuple(groups))

    def slots(self) -> Iterator[tuple[str, TensorPatch]]:
        """(name, its changes as views into the group arrays) for every changed tensor."""
        for t in self.tensors():
            yield t.name, t

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
