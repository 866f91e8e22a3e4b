"""Span patches: composing consecutive deltas is exactly applying them one by one.

Random chains over every dtype, with elements that change several times and elements
that come back to their base bits; the span is built only from the decoded deltas and the
tensor at its base, as the compaction worker builds it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.board import codec
from tests.board.codec_cases import weights


def chain_of(dtype: str, n: int, steps: int, seed: int) -> list[np.ndarray]:
    """Versions 0..steps of one tensor (raw bytes); some changes revert to version 0's bits."""
    rng = np.random.default_rng(seed)
    bits = codec.uint_dtype(dtype)
    versions = [weights(rng, n, dtype)]
    for _ in range(steps):
        new = versions[-1].copy()
        changed = rng.random(n) < rng.choice([0.0, 0.01, 0.1, 0.5])
        how = rng.integers(0, 3, n)
        new[changed & (how == 0)] = versions[0][changed & (how == 0)]
        new[changed & (how == 1)] += bits.type(1)
        randoms = changed & (how == 2)
        new[randoms] = rng.integers(0, np.iinfo(bits).max, int(randoms.sum()), dtype=bits, endpoint=True)
        versions.append(new)
    return [v.view(np.uint8).copy() for v in versions]


def span_patch(versions: list[np.ndarray], dtype: str) -> bytes:
    """The span from the first version to the last, from the deltas alone."""
    deltas = [codec.encode(old, new, dtype) for old, new in itertools.pairwise(versions)]
    decoded = [codec.decode(patch, old) for patch, old in zip(deltas, versions, strict=False)]
    return codec.encode_changes(codec.compose(decoded), versions[0], dtype)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(list(codec.WIDTHS)),
    n=st.one_of(st.sampled_from([0, 1, 9, 64]), st.integers(0, 3000)),
    steps=st.integers(2, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_span_is_the_deltas_applied_one_by_one(dtype: str, n: int, steps: int, seed: int) -> None:
    versions = chain_of(dtype, n, steps, seed)
    patch = span_patch(versions, dtype)
    header = codec.read_header(patch)
    assert header.base_digest == codec.digest(versions[0], dtype)
    assert header.result_digest == codec.digest(versions[-1], dtype)
    assert codec.apply(versions[0], patch).tobytes() == versions[-1].tobytes()
    # bit for bit the patch of the pair: `bench codec`'s figures at k > 1 are the spans'
    assert patch == codec.encode(versions[0], versions[-1], dtype)
    direct = codec.diff(versions[0], versions[-1], dtype)
    assert header.changed == direct.count  # elements that came back drop out
    got = codec.decode(patch, versions[0], header.base_digest)
    assert np.array_equal(got.positions, direct.positions)
    assert np.array_equal(got.new_bits, direct.new_bits)


def fold(chain: list[codec.Changes]) -> dict[int, tuple[int, int]]:
    """What `compose` means, one change at a time: per position the first old bits and the
    last new bits, positions back at their first old bits dropped."""
    held: dict[int, tuple[int, int]] = {}
    for c in chain:
        for p, o, n in zip(c.positions.tolist(), c.old_bits.tolist(), c.new_bits.tolist(), strict=True):
            held[p] = (held[p][0] if p in held else o, n)
    return {p: on for p, on in held.items() if on[0] != on[1]}


@settings(max_examples=150, deadline=None)
@given(
    numel=st.integers(1, 40),
    sets=st.lists(st.lists(st.tuples(st.integers(0, 39), st.integers(0, 3), st.integers(0, 3))), max_size=6),
)
def test_compose_is_the_fold_of_its_change_sets(numel: int, sets: list[list[tuple[int, int, int]]]) -> None:
    """Any change sets of one tensor (each sorted, positions unique; later sets need not
    start from earlier sets' bits): positions sorted and unique, the earliest old bits and
    the latest new bits, each position as often as chance has it (few bit values, many
    repeats and reverts)."""
    chain = []
    for changes in sets:
        by_position = {p % numel: (o, n) for p, o, n in changes if o != n}
        positions = np.array(sorted(by_position), dtype=np.int64)
        old = np.array([by_position[p][0] for p in positions.tolist()], dtype=np.uint16)
        new = np.array([by_position[p][1] for p in positions.tolist()], dtype=np.uint16)
        chain.append(codec.Changes("BF16", numel, positions, old, new))
    if not chain:
        return
    got = codec.compose(chain)
    want = fold(chain)
    assert got.positions.tolist() == sorted(want)
    assert got.old_bits.tolist() == [want[p][0] for p in sorted(want)]
    assert got.new_bits.tolist() == [want[p][1] for p in sorted(want)]
    assert got.positions.dtype == np.int64 and got.old_bits.dtype == got.new_bits.dtype == np.uint16


def test_a_span_refuses_any_base_but_its_own() -> None:
    versions = chain_of("BF16", 2000, 4, seed=7)
    patch = span_patch(versions, "BF16")
    for wrong in versions[1:]:
        with pytest.raises(codec.PatchError, match="wrong base"):
            codec.apply(wrong, patch)


def test_compose_refuses_changes_of_different_tensors() -> None:
    with pytest.raises(codec.PatchError):
        codec.compose([codec.empty_changes("BF16", 4), codec.empty_changes("BF16", 5)])
    with pytest.raises(codec.PatchError):
        codec.compose([])
