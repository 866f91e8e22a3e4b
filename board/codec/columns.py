"""Many tensors' changes as columns: one array per field, tensor i's at `bounds[i]:bounds[i + 1]`.

A diff batch finds the changes of thousands of small tensors at once (an MoE model has
one tensor per expert projection) as a few arrays. Cutting them into a `Changes` (and a
`ContextHint`) per tensor only for `encode_batch` to join them again cost a Python object
and three slices per tensor on the way out, and a comprehension and a concatenation per
column on the way in, under the GIL that the diff's helper threads need to launch their
kernels. Columns pass from the diff to the encoder as they were found: a bundle of
consecutive tensors is a slice of each array (`take`), with no step per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deltaboard.board.codec.changes import Changes
from deltaboard.board.codec.dtypes import uint_dtype
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.ranked import ContextHint


def one_width(dtypes: Sequence[str]) -> np.dtype[np.unsignedinteger]:
    """The unsigned type of the tensors' bit patterns, which must all have one width."""
    bits = uint_dtype(dtypes[0])
    if any(uint_dtype(dtype) != bits for dtype in set(dtypes)):
        raise PatchError("encode_batch: tensors of one element width expected")
    return bits


@dataclass(frozen=True)
class ChangeColumns:
    """The `Changes` of consecutive tensors of one element width, end to end: tensor i has
    dtype `dtypes[i]`, `numels[i]` elements, and its changes at `bounds[i]:bounds[i + 1]`
    of `positions`, `old_bits` and `new_bits` (each tensor's positions local to it)."""

    dtypes: Sequence[str]
    numels: np.ndarray  # int64, a tensor each
    bounds: np.ndarray  # int64, one more than tensors, from 0
    positions: np.ndarray
    old_bits: np.ndarray
    new_bits: np.ndarray

    @classmethod
    def of(cls, changes: Sequence[Changes]) -> ChangeColumns:
        """Separate `Changes` joined (a copy of their arrays)."""
        if not changes:
            raise PatchError("changes: no tensor given")
        shapes = [c.positions.shape for c in changes]
        if (
            any(len(shape) != 1 for shape in shapes)
            or [c.old_bits.shape for c in changes] != shapes
            or [c.new_bits.shape for c in changes] != shapes
        ):
            raise PatchError("changes: positions, old_bits and new_bits differ in length")
        dtypes = [c.dtype for c in changes]
        bits = one_width(dtypes)
        return cls.joined(
            dtypes,
            np.array([c.numel for c in changes], dtype=np.int64),
            [shape[0] for shape in shapes],
            np.concatenate([c.positions for c in changes], dtype=np.int64),
            np.concatenate([c.old_bits for c in changes], dtype=bits),
            np.concatenate([c.new_bits for c in changes], dtype=bits),
        )

    @classmethod
    def joined(
        cls,
        dtypes: Sequence[str],
        numels: np.ndarray,
        counts: Sequence[int] | np.ndarray,
        positions: np.ndarray,
        old_bits: np.ndarray,
        new_bits: np.ndarray,
    ) -> ChangeColumns:
        """Tensors whose changes lie end to end in the arrays, `counts[i]` of tensor i."""
        bounds = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        return cls(dtypes, numels, bounds, positions, old_bits, new_bits)

    def __len__(self) -> int:
        return len(self.dtypes)

    @property
    def counts(self) -> np.ndarray:
        """Each tensor's changed elements."""
        return np.diff(self.bounds)

    def take(self, start: int, stop: int) -> ChangeColumns:
        """Tensors `start:stop`, their arrays views of these."""
        lo, hi = int(self.bounds[start]), int(self.bounds[stop])
        return ChangeColumns(
            self.dtypes[start:stop],
            self.numels[start:stop],
            self.bounds[start : stop + 1] - lo,
            self.positions[lo:hi],
            self.old_bits[lo:hi],
            self.new_bits[lo:hi],
        )

    def tensor(self, i: int) -> Changes:
        """Tensor i's `Changes` (views)."""
        lo, hi = int(self.bounds[i]), int(self.bounds[i + 1])
        return Changes(
            self.dtypes[i],
            int(self.numels[i]),
            self.positions[lo:hi],
            self.old_bits[lo:hi],
            self.new_bits[lo:hi],
        )


@dataclass(frozen=True)
class HintColumns:
    """The `ContextHint`s of a `ChangeColumns`' tensors: row i of `thresholds` is tensor i's
    (t_low, t_top), or (-1, -1) where it has none; `ranks` is aligned with the changes
    (read only in the ranges of tensors with a hint)."""

    thresholds: np.ndarray  # int64, [tensors, 2]
    ranks: np.ndarray  # int64 or int32, one per change

    def __len__(self) -> int:
        return int(self.thresholds.shape[0])

    @classmethod
    def of(cls, hints: Sequence[ContextHint | None], bounds: np.ndarray) -> HintColumns:
        """Separate hints (None: none) of the tensors whose changes `bounds` delimits."""
        sizes = np.diff(bounds).tolist()
        if len(sizes) != len(hints) or any(
            h is not None and h.ranks.shape != (size,) for h, size in zip(hints, sizes, strict=True)
        ):
            raise PatchError("context hint: one rank per changed element expected")
        blank = np.zeros(max(sizes, default=0), dtype=np.int64)  # read nowhere: no hint given
        # a hint's thresholds as given (`encode_batch` refuses bad ones), none as -1
        thresholds = np.array([(-1, -1) if h is None else (h.t_low, h.t_top) for h in hints], np.int64)
        if (thresholds[[h is not None for h in hints], 0] < 0).any():
            raise PatchError("context hint: bad thresholds")
        ranks = np.concatenate(
            [blank[:size] if h is None else h.ranks for h, size in zip(hints, sizes, strict=True)],
            dtype=np.int64,
        )
        return cls(thresholds.reshape(-1, 2), ranks)

    def take(self, start: int, stop: int, bounds: np.ndarray) -> HintColumns:
        """Tensors `start:stop`, whose changes `bounds` delimits."""
        return HintColumns(self.thresholds[start:stop], self.ranks[int(bounds[start]) : int(bounds[stop])])

    def hint(self, i: int, bounds: np.ndarray) -> ContextHint | None:
        """Tensor i's `ContextHint` (its ranks a view), None where it has none."""
        t_low, t_top = self.thresholds[i].tolist()
        if t_low < 0:
            return None
        return ContextHint(t_low, t_top, self.ranks[int(bounds[i]) : int(bounds[i + 1])])
