"""The sampled exponent counts of a view buffer's tensors, kept from one version to the next
for the context hints that the device diff computes.

`codec.plan_thresholds` plans a tensor's classes from the exponent counts of its old
elements (every element of a small tensor, every 32nd of a large one: the contract's
sample). Counted afresh, that is a pass over the sample of every changed tensor at every
version, and a kernel or more per tensor: a model of thousands of small tensors would pay
both per tensor, every version. A delta moves the counts only where it changes a sampled
element, so the diff counts a tensor once and from then on moves its counts by the
changes (`device_diff`), into the new buffer's table. The old buffer's table is only read:
a version that fails leaves its base's counts true, and `ViewBuffer.fill` forgets a
buffer's counts with the bytes they described. (`exponents.ExponentCounts` is the same
idea for host tensors, whose counts the encoder moves.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from deltaboard.board import codec

if TYPE_CHECKING:
    from deltaboard.publisher.snapshot import SlotBatch, ViewLayout


class SampledCounts:
    """A row of exponent counts per slot of a layout (layout order), as wide as its widest
    exponent range; a row whose first entry is -1 is not known."""

    def __init__(self, layout: ViewLayout) -> None:
        columns = max(
            (codec.EXPONENT_FIELDS[s.dtype][1] + 1 for s in layout.slots if s.dtype in codec.EXPONENT_FIELDS),
            default=1,
        )
        self.table = np.full((len(layout.slots), columns), -1, dtype=np.int64)
        self._row = {slot.name: row for row, slot in enumerate(layout.slots)}

    def rows(self, slots: SlotBatch) -> slice:
        """The rows of `slots`, a diff batch: consecutive slots of the layout
        (`device_diff.batches`), so consecutive rows, read and written in place."""
        first = self._row[slots[0].name]
        if self._row[slots[-1].name] != first + len(slots) - 1:
            raise ValueError("a diff batch's slots are consecutive slots of the layout")
        return slice(first, first + len(slots))

    def forget(self) -> None:
        self.table[:, 0] = -1
