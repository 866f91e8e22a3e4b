"""Each tensor's exponent counts, kept with a host view buffer from one version to the next.

The codec's context encoding plans its classes from the old tensor's exponent counts
(`codec.plan_thresholds`, step 2): every element of a small tensor, every 32nd of a large
one. Counted afresh for each delta, that is a pass over every small tensor per version,
which a model of many small tensors pays per tensor. A delta moves the counts only where
it changes elements, so they are counted once and then kept: the encoder hands the
base's counts to `codec.encode_batch`, which moves them by each patch's changes, and the
moved counts stay with the new view (`ViewBuffer.exponent_counts`), which is the next
delta's base once committed. A buffer's counts go when it is filled again, and a base
whose counts a failed version moved keeps none, so counts only ever describe the bytes
beside them; a tensor without kept counts is counted by the codec as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from deltaboard.board import codec


def block_or_rows(rows: np.ndarray) -> slice | np.ndarray:
    """Table rows as a slice where they are consecutive and ascending (read and written in
    place, as one block), else as they are (gathered and scattered)."""
    first = int(rows[0]) if rows.size else 0
    block = np.arange(first, first + rows.size)
    return slice(first, first + rows.size) if np.array_equal(rows, block) else rows


class ExponentCounts:
    """A row of counts per tensor in a table per element width (a bundle's tensors share
    one: `take` and `put` read and write them as the codec's `counts`); a row whose first
    entry is -1 is not known."""

    def __init__(self, tensors: Iterable[tuple[str, str]]) -> None:
        """`tensors`: (name, dtype) of every tensor on the host."""
        rows: dict[int, list[str]] = {}
        columns: dict[int, int] = {}
        for name, dtype in tensors:
            width = codec.width(dtype)
            rows.setdefault(width, []).append(name)
            mask = codec.EXPONENT_FIELDS.get(dtype, (0, 0))[1]
            columns[width] = max(columns.get(width, 1), mask + 1)
        self._tables = {w: np.full((len(names), columns[w]), -1, dtype=np.int64) for w, names in rows.items()}
        self._widths = {name: w for w, names in rows.items() for name in names}
        self._rows = {name: row for names in rows.values() for row, name in enumerate(names)}

    def _where(self, names: Sequence[str]) -> tuple[np.ndarray, slice | np.ndarray]:
        """The table of `names` and their rows in it: a slice where they are consecutive (a
        bundle's tensors in layout order, not interleaved with another width's), so that
        they are read and written as one block, not gathered and scattered row by row
        (2 KB a bf16 tensor: ~80 MB a version for 20,000 small tensors)."""
        rows = np.fromiter(map(self._rows.__getitem__, names), dtype=np.int64, count=len(names))
        return self._tables[self._widths[names[0]]], block_or_rows(rows)

    def take(self, names: Sequence[str]) -> np.ndarray:
        """The rows of `names` (tensors of one element width, as a delta's bundle), for the
        codec to move in place: a view of the table where they are consecutive, else a
        copy, which `put` writes back."""
        table, rows = self._where(names)
        taken: np.ndarray = table[rows]
        return taken

    def put(self, names: Sequence[str], counts: np.ndarray) -> None:
        """Replace the rows of `names` with `counts` (as `take` gave them, moved by the
        codec); nothing to write (or look up) where `take` gave a view of the table."""
        if np.may_share_memory(self._tables[self._widths[names[0]]], counts):
            return
        table, rows = self._where(names)
        table[rows] = counts

    def count(self, names: Sequence[str], tensors: Sequence[tuple[np.ndarray, str]]) -> None:
        """Count the rows of `names` from their bytes and dtypes (a keyframe's tensors, of
        any widths, so that the first delta after it starts from counts too), as the
        planning contract samples them."""
        for name, (data, dtype) in zip(names, tensors, strict=True):
            if dtype in codec.EXPONENT_FIELDS:
                bits = data.view(codec.uint_dtype(dtype))
                sample = np.ascontiguousarray(bits[:: codec.sample_stride(bits.size)])
                found = codec.exponent_counts(sample, dtype)
                self._tables[self._widths[name]][self._rows[name], : found.size] = found
