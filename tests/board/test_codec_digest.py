"""The additive digest: O(changed) updates equal full recomputation, and it sees changes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from deltaboard.board import codec
from tests.board.codec_cases import Case, cases, make_case

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(cases())
def test_digest_update_equals_full_digest(case: Case) -> None:
    changes = codec.diff(case.old, case.new, case.dtype)
    updated = codec.digest_update(codec.digest(case.old, case.dtype), changes)
    assert updated == codec.digest(case.new, case.dtype)


def test_digest_is_hex_of_two_lanes_and_sees_every_kind_of_change() -> None:
    case = make_case("BF16", 4096, "none", seed=2)
    base = codec.digest(case.old, "BF16")
    assert len(base) == 32 and int(base, 16) >= 0
    bits = case.old.view(np.uint16)
    seen = {base}
    for i in (0, 1, 2047, 4095):
        for flip in (1, 0x8000):
            other = bits.copy()
            other[i] ^= flip
            seen.add(codec.digest(other.view(np.uint8), "BF16"))
    swapped = bits.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    if swapped[3] != swapped[4]:
        seen.add(codec.digest(swapped.view(np.uint8), "BF16"))
        assert len(seen) == 10
    else:
        assert len(seen) == 9


def test_digest_depends_on_dtype_width_not_on_threads() -> None:
    data = make_case("F32", 1_000_003, "none", seed=3).old
    small = codec.digest_bits(data.view(np.uint32)[:1000])
    assert codec.digest(data[:4000], "F32") == small
    full = codec.digest(data, "F32")
    # the threaded full pass and a piecewise sum of updates agree
    zeros = np.zeros_like(data)
    changes = codec.diff(zeros, data, "F32")
    assert codec.digest_update(codec.digest(zeros, "F32"), changes) == full
    assert codec.digest(data, "F32") != codec.digest(data, "BF16")


def test_state_digest_is_order_independent() -> None:
    entries = [("b", "1" * 32), ("a", "2" * 32)]
    assert codec.state_digest(entries) == codec.state_digest(reversed(entries))
    assert codec.state_digest(entries) != codec.state_digest([("b", "2" * 32), ("a", "1" * 32)])
    assert len(codec.state_digest(entries)) == 64


def test_bad_digest_strings_are_refused() -> None:
    changes = codec.empty_changes("BF16", 0)
    with pytest.raises(codec.PatchError):
        codec.digest_update("xyz", changes)
    with pytest.raises(codec.PatchError):
        codec.digest_update("g" * 32, changes)


def test_state_digest_is_sha256_of_the_sorted_lines() -> None:
    """Stored manifests keep their state digests: sha256 over `name NUL digest LF` per tensor."""
    entries = [("b.weight", "2" * 32), ("a.weight", "1" * 32), ("ü", "3" * 32)]
    reference = hashlib.sha256()
    for name, value in sorted(entries):
        reference.update(name.encode() + b"\0" + value.encode() + b"\n")
    assert codec.state_digest(entries) == reference.hexdigest()


def test_sorted_state_digest_is_the_state_digest_of_sorted_distinct_names() -> None:
    """A publisher's names, sorted once per layout, give the state digest without a sort;
    names out of order or twice are refused (they would give another digest)."""
    entries = [("a.weight", "1" * 32), ("b.weight", "2" * 32), ("ü", "3" * 32)]
    names, values = [n for n, _ in entries], [v for _, v in entries]
    assert codec.sorted_state_digest(names, values) == codec.state_digest(reversed(entries))
    assert codec.sorted_state_digest([], []) == codec.state_digest([]) == hashlib.sha256().hexdigest()
    for bad in (names[::-1], [names[0], names[0], names[2]]):
        with pytest.raises(ValueError):
            codec.sorted_state_digest(bad, values)
    with pytest.raises(ValueError):
        codec.sorted_state_digest(names, values[:2])
