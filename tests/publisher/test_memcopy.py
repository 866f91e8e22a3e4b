"""The snapshot's non-temporal copy against plain slicing (every byte, nothing else)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.publisher.memcopy import stream_copy


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
