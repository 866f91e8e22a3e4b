"""`context` positions: ranks within classes of the old exponent.

The receiver holds the old tensor, so it splits it into the classes of
`deltaboard.board.codec.context` itself; the patch carries the two thresholds, then per class the
Rice-coded gaps between the ranks of its changed elements. It costs one pass over the old
tensor on both sides, which is why the encoder only picks it when the classes save enough.

The encoder needs only a `ContextHint`: the thresholds and each changed element's rank in
its class. `context_hint` computes it from the old bytes on the host; the publisher's
device path computes the same hint where the tensor lives and moves only the hint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltaboard.board.codec.bitio import Reader, Writer, put_index_sets, put_u64, rice_groups, written
from deltaboard.board.codec.changes import Changes
from deltaboard.board.codec.classes import class_positions, ranks_within, split_ranks
from deltaboard.board.codec.context import EXPONENT_FIELDS, count_exponents, plan, sample_stride
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.jit import kernel


@dataclass(frozen=True)
class ContextHint:
    """What the `context` encoding needs from the old tensor, for one `Changes`: the class
    thresholds (`deltaboard.board.codec.context.plan_thresholds`) and, per changed element, its
    rank within its class (the number of class members before it in the old tensor).
    `plan_thresholds` states how to compute it elsewhere."""

    t_low: int
    t_top: int
    ranks: np.ndarray


@kernel
def host_hint(
    old: np.ndarray, positions: np.ndarray, shift: int, mask: int, sampled: np.ndarray, changed: np.ndarray
) -> tuple[int, int, np.ndarray]:
    """(t_low, t_top, ranks), t_low -1 for no hint: the steps of `plan_thresholds`'s contract
    in one compiled call (its fixed cost is what a model of many small tensors pays), from
    `sampled`, the exponent counts of `old` at its sample stride, and `changed`, those of
    the changed elements' old bits. Counted by the caller, or `sampled` kept by it from an
    earlier version (`batch.encode_batch`): a small tensor's are counted over every
    element, a pass over the tensor that a kept count saves."""
    t_low, t_top = plan(sampled, changed, old.size)
    if t_low < 0:
        return t_low, t_top, positions[:0]
    return t_low, t_top, ranks_within(old, positions, shift, t_low, t_top)


def context_hint(changes: Changes, old_bits: np.ndarray) -> ContextHint | None:
    """The hint from the old bits on the host; None when the classes do not pay off."""
    shift, mask = EXPONENT_FIELDS[changes.dtype]
    t_low, t_top, ranks = host_hint(
        old_bits,
        changes.positions.astype(np.int64, copy=False),
        shift,
        mask,
        count_exponents(old_bits, shift, mask, sample_stride(old_bits.size)),
        count_exponents(changes.old_bits, shift, mask),
    )
    return None if t_low < 0 else ContextHint(t_low, t_top, ranks)


def encode(w: Writer, changes: Changes, hint: ContextHint) -> None:
    """Thresholds, class counts, then each class's ranks as gaps. A hint that cannot be
    right (ranks not increasing within a class, or past their position) is refused."""
    if (
        changes.dtype not in EXPONENT_FIELDS
        or not 0 <= hint.t_low <= hint.t_top <= EXPONENT_FIELDS[changes.dtype][1] + 1
    ):
        raise PatchError(f"context hint: bad thresholds {hint.t_low}, {hint.t_top} for {changes.dtype}")
    if hint.ranks.shape != changes.positions.shape:
        raise PatchError("context hint: one rank per changed element expected")
    per_class = split_ranks(
        changes.old_bits, changes.dtype, hint.t_low, hint.t_top, changes.positions, hint.ranks
    )
    w.extend(written(put_ranks, hint.t_low, hint.t_top, *per_class))


@kernel
def put_ranks(
    buf: np.ndarray, at: int, t_low: int, t_top: int, r0: np.ndarray, r1: np.ndarray, r2: np.ndarray
) -> tuple[np.ndarray, int]:
    """Thresholds, class counts and each class's ranks as gaps, in one compiled call."""
    for field in (t_low, t_top, r0.size, r1.size, r2.size):
        buf, at = put_u64(buf, at, field)
    bounds = np.array([0, r0.size, r0.size + r1.size, r0.size + r1.size + r2.size], dtype=np.int64)
    return put_index_sets(buf, at, np.concatenate((r0, r1, r2)), bounds)


def decode(r: Reader, changed: int, old_bits: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The changed positions and the old bits there (read in the same pass)."""
    if dtype not in EXPONENT_FIELDS:
        raise PatchError(f"corrupted patch: context encoding for {dtype}")
    t_low, t_top = r.u64(), r.u64()
    if not t_low <= t_top <= EXPONENT_FIELDS[dtype][1] + 1:
        raise PatchError(f"corrupted patch: exponent classes {t_low}, {t_top}")
    counts = [r.u64() for _ in range(3)]
    if sum(counts) != changed:
        raise PatchError("corrupted patch: class counts do not add up to the changed count")
    # read in the select's pass, as it reaches them: ranks past their class or the tensor
    # are never found, which `class_positions` reports
    return class_positions(old_bits, dtype, t_low, t_top, rice_groups(r, counts))
