"""The host's compiled passes by address, element by element: the swap's prefetching body
and its last `_AHEAD` changes are separate loops, so a drift anywhere, and passes shorter
than the prefetch distance, are checked at every index; the unchecked store (the bench's
floor) writes exactly the given values."""

from __future__ import annotations

import numpy as np
import pytest

from deltaboard.clients.resident import scatter


def _memory(n: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A buffer of `n` elements, every other one addressed: (buffer, positions, addresses)."""
    rng = np.random.default_rng(seed)
    memory = rng.integers(0, 1 << (8 * width - 1), n, dtype=np.dtype(f"<u{width}"))
    positions = np.arange(0, n, 2, dtype=np.int64)
    return memory, positions, memory.ctypes.data + positions * width


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "changes", [1, scatter._AHEAD - 1, scatter._AHEAD, scatter._AHEAD + 1, 3 * scatter._AHEAD]
)
def test_a_swap_refuses_a_drift_at_any_index_and_leaves_memory_as_it_was(width: int, changes: int) -> None:
    memory, positions, addrs = _memory(2 * changes, width, changes)
    old = memory[positions].copy()
    new = old ^ old.dtype.type(1)
    for drift in range(changes):
        memory[positions[drift]] ^= old.dtype.type(2)
        before = memory.copy()
        assert scatter.swap(addrs, old, new) == drift
        assert np.array_equal(memory, before)
        memory[positions[drift]] ^= old.dtype.type(2)
    assert scatter.swap(addrs, old, new) == -1
    expected = memory.copy()
    expected[positions] = new
    assert np.array_equal(memory, expected)  # every change swapped, nothing else touched


@pytest.mark.parametrize("elements", [2 * scatter._AHEAD - 2, 300_000])  # shorter than a prefetch; spread
def test_put_stores_the_values_and_nothing_else(elements: int) -> None:
    memory, positions, addrs = _memory(elements, 2, 1)
    values = np.random.default_rng(2).integers(0, 1 << 16, positions.size, dtype=np.uint16)
    expected = memory.copy()
    expected[positions] = values
    scatter.put(addrs, values)
    assert np.array_equal(memory, expected)
