"""The snapshot's non-temporal copy against plain slicing (every byte, nothing else)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.publisher.memcopy import gather_copy, stream_copy


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 130), st.integers(0, 70), st.integers(0, 70))
def test_stream_copy_copies_every_byte_and_nothing_else(size: int, dst_offset: int, src_offset: int) -> None:
    src = np.random.default_rng(size).integers(0, 256, size=src_offset + size + 64, dtype=np.uint8)
    dst = np.zeros(dst_offset + size + 64, dtype=np.uint8)
    stream_copy(dst[dst_offset : dst_offset + size], src[src_offset : src_offset + size])
    assert np.array_equal(dst[dst_offset : dst_offset + size], src[src_offset : src_offset + size])
    assert not dst[:dst_offset].any() and not dst[dst_offset + size :].any()


def test_stream_copy_refuses_other_arrays() -> None:
    with pytest.raises(ValueError, match="uint8"):
        stream_copy(np.zeros(4, dtype=np.uint8), np.zeros(5, dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        stream_copy(np.zeros(4, dtype=np.uint16), np.zeros(4, dtype=np.uint16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 9)), max_size=12))
def test_gather_copy_copies_every_source_to_its_start_and_nothing_else(
    sources: list[tuple[int, int]],
) -> None:
    """Sources of any size and alignment, each at its own start after a gap: every byte
    lands, the gaps stay zero."""
    rng = np.random.default_rng(len(sources))
    arrays = [rng.integers(1, 256, size=n, dtype=np.uint8) for n, _ in sources]
    starts, at = [], 0
    for n, gap in sources:
        starts.append(at + gap)
        at += gap + n
    dst = np.zeros(at + 64, dtype=np.uint8)
    gather_copy(
        dst,
        np.array(starts, dtype=np.int64),
        np.array([a.ctypes.data for a in arrays], dtype=np.uint64),
        np.array([a.size for a in arrays], dtype=np.int64),
    )
    want = np.zeros_like(dst)
    for a, start in zip(arrays, starts, strict=True):
        want[start : start + a.size] = a
    assert np.array_equal(dst, want)


def test_gather_copy_refuses_a_source_past_dst() -> None:
    one = np.ones(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        gather_copy(
            np.zeros(8, dtype=np.uint8), np.array([1]), np.array([one.ctypes.data], np.uint64), np.array([8])
        )
