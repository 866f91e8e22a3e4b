"""Span patches: the changes from version a to version b (b - a > 1) of one tensor.

A span is an ordinary patch whose base is the tensor at a and whose result is the tensor
at b, so a follower applies it with the same `decode`/`apply` and the same digests as a
delta. It is built from the consecutive deltas' `Changes` (each decoded against the tensor
at its own base), never from the tensor at b: `compose` keeps the union of the positions,
the old bits of the first version that changed each one and the new bits of the last, and
drops the positions that came back to their old bits. The result digest then follows from
the base digest in O(changes) (`digest_update`), which is what makes a wrong chain
detectable before anything is uploaded: it must equal the tensor's digest at b.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deltaboard.board.codec.changes import Changes, empty_changes
from deltaboard.board.codec.errors import PatchError


def compose(chain: Sequence[Changes]) -> Changes:
    """The changes of applying `chain` (consecutive, each against the previous result) at once."""
    if not chain:
        raise PatchError("a span composes at least one change set")
    first = chain[0]
    if any((c.dtype, c.numel) != (first.dtype, first.numel) for c in chain):
        raise PatchError("a span composes changes of one tensor (same dtype and size)")
    if len(chain) == 1:
        return first
    positions = np.concatenate([c.positions for c in chain])
    if not positions.size:
        return empty_changes(first.dtype, first.numel)
    old_bits = np.concatenate([c.old_bits for c in chain])
    new_bits = np.concatenate([c.new_bits for c in chain])
    # One stable sort: equal positions stay in chain order, so the first of each run is
    # the earliest version (its old bits) and the last the latest (its new bits). Each
    # change set is already sorted, so the sort merges sorted runs.
    order = np.argsort(positions, kind="stable")
    ordered = positions[order]
    starts = np.empty(ordered.size, dtype=bool)
    starts[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    ends = np.empty_like(starts)
    ends[-1] = True
    ends[:-1] = starts[1:]
    unique = ordered[starts]
    before = old_bits[order[starts]]
    after = new_bits[order[ends]]
    moved = before != after
    return Changes(first.dtype, first.numel, unique[moved], before[moved], after[moved])
