"""The codec's compiled kernels against plain numpy references (bit-exact)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.board import codec
from deltaboard.board.codec.bitio import (
    Reader,
    RiceGroups,
    Writer,
    encode_index_sets,
    put_fixed,
    read_field,
    rice_groups,
    written,
)
from deltaboard.board.codec.classes import (
    _select_bit_deposit,
    _select_bit_search,
    class_positions,
    class_ranks,
    split_ranks,
)
from deltaboard.board.codec.context import EXPONENT_FIELDS, count_exponents
from deltaboard.board.codec.digest import digest_bits
from deltaboard.board.codec.jit import FAST_DEPOSIT

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
UINTS: dict[str, Any] = {
    "BF16": np.uint16,
    "F32": np.uint32,
    "F64": np.uint64,
    "F8_E4M3": np.uint8,
    "I32": np.uint32,
}


@st.composite
def bit_pairs(draw: st.DrawFn) -> tuple[str, np.ndarray, np.ndarray]:
    """Old and new element bits of one dtype, sizes across 64-element words, changes
    anywhere (first, last, runs, sparse)."""
    dtype = draw(st.sampled_from(sorted(UINTS)))
    n = draw(st.sampled_from([0, 1, 63, 64, 65, 127, 128, 1000, 4097]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    info = np.iinfo(UINTS[dtype])
    old = rng.integers(0, info.max, size=n, dtype=UINTS[dtype], endpoint=True)
    new = old.copy()
    if n:
        density = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
        hit = rng.random(n) < density
        hit[draw(st.integers(0, n - 1))] = draw(st.booleans())
        new[hit] ^= UINTS[dtype](1) << UINTS[dtype](draw(st.integers(0, 8 * info.bits // 8 - 1)))
    return dtype, old, new


@SETTINGS
@given(bit_pairs())
def test_diff_matches_numpy(pair: tuple[str, np.ndarray, np.ndarray]) -> None:
    dtype, old, new = pair
    got = codec.diff(old.view(np.uint8), new.view(np.uint8), dtype)
    want = np.flatnonzero(old != new)
    assert np.array_equal(got.positions, want)
    assert np.array_equal(got.old_bits, old[want]) and np.array_equal(got.new_bits, new[want])
    assert got.old_bits.dtype == old.dtype


@SETTINGS
@given(
    st.sampled_from(sorted(set(UINTS) & set(EXPONENT_FIELDS))),
    st.integers(0, 300),
    st.integers(1, 40),
    st.integers(0, 2**31 - 1),
)
def test_exponent_counts_match_numpy_for_every_size_and_stride(
    dtype: str, n: int, stride: int, seed: int
) -> None:
    """`count_exponents` (lanes over a whole tensor, a plain loop over a sample) counts each
    element read once, whatever the size's remainder against its lanes and the stride (the
    hint's thresholds follow it)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, np.iinfo(UINTS[dtype]).max, size=n, dtype=UINTS[dtype], endpoint=True)
    bits[: n // 2] = bits[0] if n else 0  # runs of one exponent, as in a weight matrix
    shift, mask = EXPONENT_FIELDS[dtype]
    exponents = ((bits >> UINTS[dtype](shift)) & UINTS[dtype](mask)).astype(np.int64)
    want = np.bincount(exponents[::stride], minlength=mask + 1)
    assert np.array_equal(count_exponents(bits, shift, mask, stride), want)


def test_diff_splits_large_tensors_between_threads_exactly() -> None:
    rng = np.random.default_rng(3)
    old = rng.integers(0, 2**16, size=(1 << 21) + 77, dtype=np.uint16)
    new = old.copy()
    idx = rng.choice(old.size, 20_000, replace=False)
    new[idx] ^= np.uint16(1)
    got = codec.diff(old.view(np.uint8), new.view(np.uint8), "BF16")
    assert np.array_equal(got.positions, np.sort(idx))


def _classes(old: np.ndarray, dtype: str, t_low: int, t_top: int) -> np.ndarray:
    shift = EXPONENT_FIELDS[dtype][0]
    m = old & old.dtype.type((1 << (8 * old.itemsize - 1)) - 1)
    cls: np.ndarray = (m >= old.dtype.type(t_low << shift)).astype(np.int64)
    cls += m >= old.dtype.type(t_top << shift)
    return cls


def _coded(ranks: list[np.ndarray]) -> RiceGroups:
    """Each class's ranks as the `context` encoding writes them (gaps, Rice-coded)."""
    w = Writer()
    encode_index_sets(w, ranks)
    return rice_groups(Reader(w.getvalue()), [r.size for r in ranks])


@SETTINGS
@given(bit_pairs(), st.data())
def test_rank_and_select_invert_each_other(
    pair: tuple[str, np.ndarray, np.ndarray], data: st.DataObject
) -> None:
    dtype, old, new = pair
    if dtype not in EXPONENT_FIELDS:
        return
    top = EXPONENT_FIELDS[dtype][1] + 1
    t_low = data.draw(st.integers(0, top))
    t_top = data.draw(st.integers(t_low, top))
    positions = np.flatnonzero(old != new)
    cls = _classes(old, dtype, t_low, t_top)
    # reference: rank = members of the element's class before it
    want = np.array([np.count_nonzero(cls[:p] == cls[p]) for p in positions], dtype=np.int64)
    ranks = class_ranks(old, dtype, t_low, t_top, positions)
    assert np.array_equal(ranks, want)
    per_class = split_ranks(old[positions], dtype, t_low, t_top, positions, ranks)
    assert [r.tolist() for r in per_class] == [want[cls[positions] == c].tolist() for c in range(3)]
    found, old_at = class_positions(old, dtype, t_low, t_top, _coded(per_class))
    assert np.array_equal(found, positions)
    assert np.array_equal(old_at, old[positions]) and old_at.dtype == old.dtype
    if positions.size:  # a rank past its class is refused, never read out of bounds
        members = int(np.count_nonzero(cls == cls[positions[-1]]))
        bad = [r.copy() for r in per_class]
        bad[int(cls[positions[-1]])][-1] = members
        try:
            class_positions(old, dtype, t_low, t_top, _coded(bad))
        except codec.PatchError:
            pass
        else:
            raise AssertionError("a rank past its class was accepted")


@SETTINGS
@given(st.integers(1, 63), st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=100))
def test_read_field_reads_each_field_of_any_width(k: int, values: list[int]) -> None:
    """The values decoder reads each step's low bits in place (`read_field`): one word
    read up to 56 bits, two above, at every bit offset."""
    v = np.array(values, dtype=np.uint64) & np.uint64((1 << k) - 1)
    r = Reader(written(put_fixed, v, k))
    packed = bytes(r.section())
    r.done()
    assert len(packed) == (v.size * k + 7) // 8
    padded = np.frombuffer(packed + bytes(8), dtype=np.uint8)
    assert [int(read_field(padded, j * k, k)) for j in range(v.size)] == v.tolist()


def test_steps_of_every_size_class_roundtrip() -> None:
    """Steps whose |d| - 1 has every bit length 0..64 (64-bit elements), several of each
    and interleaved, decode bit-exact: each class's fields are read from its own section
    in element order."""
    rng = np.random.default_rng(7)
    old = rng.integers(0, 2**63, size=4096, dtype=np.uint64)
    new = old.copy()
    where = rng.choice(old.size, 65 * 6, replace=False)
    for i, p in enumerate(where):
        size = i % 65  # the bit length of v = |d| - 1
        v = (1 << (size - 1)) | int(rng.integers(0, 2**63)) & ((1 << (size - 1)) - 1) if size else 0
        step = v + 1 if i % 2 else -(v + 1)  # |d| - 1 = v, either sign
        new[p] = np.uint64((int(old[p]) + step) % 2**64)
    patch = codec.encode(old.view(np.uint8), new.view(np.uint8), "I64")
    assert np.array_equal(codec.apply(old.view(np.uint8), patch).view(np.uint64), new)


@SETTINGS
@given(bit_pairs())
def test_digest_matches_the_reference_mixes(pair: tuple[str, np.ndarray, np.ndarray]) -> None:
    _, old, _ = pair
    mask = (1 << 64) - 1
    sa = sb = 0
    for i, x in enumerate(old.tolist()):  # the documented mixes, in Python integers
        a = (((i * 0x9E3779B97F4A7C15) & mask) ^ x) * 0xBF58476D1CE4E5B9 & mask
        a = ((a ^ (a >> 32)) * 0x94D049BB133111EB) & mask
        a ^= a >> 29
        b = ((x * 0xC2B2AE3D27D4EB4F + i) & mask) * 0x165667B19E3779F9 & mask
        b = ((b ^ (b >> 31)) * 0xFF51AFD7ED558CCD) & mask
        b ^= b >> 33
        sa, sb = (sa + a) & mask, (sb + b) & mask
    assert digest_bits(old) == f"{sa:016x}{sb:016x}"


@SETTINGS
@given(st.integers(1, 2**64 - 1), st.data())
def test_select_bit_finds_the_kth_set_bit(word: int, data: st.DataObject) -> None:
    """Both selects (the bit deposit where this host has a fast one, the search elsewhere)
    pick the k-th set bit of a word."""
    bits = [b for b in range(64) if word >> b & 1]
    k = data.draw(st.integers(0, len(bits) - 1))
    want = np.uint64(1 << bits[k])
    assert _select_bit_search(np.uint64(word), k) == want
    if FAST_DEPOSIT:
        assert _select_bit_deposit(np.uint64(word), k) == want
