"""`encode_batch` writes `encode_changes`' bytes for every tensor of a batch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.board import codec
from deltaboard.board.codec.context import SAMPLE_FROM
from deltaboard.board.codec.header import pack_fields, pack_many
from tests.board.codec_cases import PATTERNS, make_case

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# dtypes by element width: a batch holds tensors of one width
WIDTH_GROUPS = [
    sorted(d for d in codec.WIDTHS if codec.width(d) == w) for w in sorted(set(codec.WIDTHS.values()))
]


@st.composite
def batches(draw: st.DrawFn) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Tensors of one width (dtypes mixed: BF16 beside F16, I16, ...), every change pattern."""
    dtypes = draw(st.sampled_from(WIDTH_GROUPS))
    count = draw(st.integers(1, 6))
    out = []
    for _ in range(count):
        n = draw(st.one_of(st.sampled_from([0, 1, 9, 64, 65]), st.integers(0, 3000)))
        case = make_case(
            draw(st.sampled_from(dtypes)), n, draw(st.sampled_from(PATTERNS)), draw(st.integers(0, 2**32 - 1))
        )
        out.append((case.dtype, case.old, case.new))
    return out


def one_buffer(tensors: list[tuple[str, np.ndarray, np.ndarray]], gap: int) -> tuple[np.ndarray, list[int]]:
    """Every old tensor in one byte buffer, `gap` elements of junk apart (as a view buffer
    holds them), and each one's first element."""
    width = codec.width(tensors[0][0])
    parts, starts, at = [], [], 0
    for _, old, _ in tensors:
        parts += [old, np.full(gap * width, 0xA5, dtype=np.uint8)]
        starts.append(at)
        at += old.size // width + gap
    return np.concatenate(parts), starts


@SETTINGS
@given(batches(), st.integers(0, 3))
def test_a_batch_is_each_tensors_own_patch(
    tensors: list[tuple[str, np.ndarray, np.ndarray]], gap: int
) -> None:
    changes = [codec.diff(old, new, dtype) for dtype, old, new in tensors]
    digests = [codec.digest(old, dtype) for dtype, old, _ in tensors]
    buffer, starts = one_buffer(tensors, gap)
    got = codec.encode_batch(changes, digests, old=buffer, old_starts=starts)
    without_old = codec.encode_batch(changes, digests)
    for (dtype, old, new), c, d, (patch, result), (bare, bare_result) in zip(
        tensors, changes, digests, got, without_old, strict=True
    ):
        assert patch == codec.encode_changes(c, old, dtype, old_digest=d)
        assert bare == codec.encode_changes(c, None, dtype, old_digest=d)
        assert result == bare_result == codec.digest(new, dtype) == codec.read_header(patch).result_digest
        assert codec.apply(old, patch).tobytes() == new.tobytes()


@SETTINGS
@given(batches(), st.integers(1, 3), st.booleans())
def test_columns_taken_from_a_larger_batch_are_each_tensors_own_patch(
    tensors: list[tuple[str, np.ndarray, np.ndarray]], before: int, hinted: bool
) -> None:
    """Columns as the publisher's diff hands them over: a bundle taken out of a batch's
    columns (its changes not at the columns' start, int32 positions), with the device's
    hints as columns (some tensors without one), give `encode_changes`' patches."""
    changes = [codec.diff(old, new, dtype) for dtype, old, new in tensors]
    hints = [
        codec.context_hint(c, old.view(codec.uint_dtype(dtype)))
        if hinted and dtype in codec.EXPONENT_FIELDS and c.count
        else None
        for (dtype, old, _), c in zip(tensors, changes, strict=True)
    ]
    # tensors ahead of the bundle in the batch: copies of its first tensor
    batch = [changes[0]] * before + changes
    joined = codec.ChangeColumns.of(batch)
    whole = codec.ChangeColumns(
        joined.dtypes, joined.numels, joined.bounds, joined.positions.astype(np.int32),
        joined.old_bits, joined.new_bits,
    )  # fmt: skip
    bundle = whole.take(before, len(batch))
    hint_columns = codec.HintColumns.of([hints[0]] * before + hints, whole.bounds).take(
        before, len(batch), whole.bounds
    )
    digests = [codec.digest(old, dtype) for dtype, old, _ in tensors]
    got = codec.encode_batch(bundle, digests, hints=hint_columns)
    for i, (c, d, h, (patch, _)) in enumerate(zip(changes, digests, hints, got, strict=True)):
        assert patch == codec.encode_changes(c, None, c.dtype, old_digest=d, hint=h)
        assert np.array_equal(bundle.tensor(i).positions, c.positions)
        assert codec.apply(tensors[i][1], patch).tobytes() == tensors[i][2].tobytes()


def test_columns_that_disagree_are_refused() -> None:
    case = make_case("BF16", 500, "ulp", 1)
    good = codec.ChangeColumns.of([codec.diff(case.old, case.new, "BF16")])
    digest = codec.digest(case.old, "BF16")
    short = codec.ChangeColumns(
        good.dtypes, good.numels, good.bounds - 1, good.positions, good.old_bits, good.new_bits
    )
    with pytest.raises(codec.PatchError, match="differ in length"):
        codec.encode_batch(short, [digest])
    wide = codec.ChangeColumns(
        good.dtypes, good.numels, good.bounds, good.positions, good.old_bits.astype(np.uint32), good.new_bits
    )
    with pytest.raises(codec.PatchError, match="one element width"):
        codec.encode_batch(wide, [digest])
    few_ranks = codec.HintColumns(np.array([[0, 3]]), np.zeros(good.positions.size - 1, dtype=np.int64))
    with pytest.raises(codec.PatchError, match="one rank per changed element"):
        codec.encode_batch(good, [digest], hints=few_ranks)


def sampled_counts(bits: np.ndarray, dtype: str, columns: int) -> np.ndarray:
    """`exponent_counts` of a tensor's elements at its sample stride, in a row of `columns`
    (what a caller keeps between versions)."""
    row = np.full(columns, -1, dtype=np.int64)
    if dtype in codec.EXPONENT_FIELDS:
        sample = np.ascontiguousarray(bits.view(codec.uint_dtype(dtype))[:: codec.sample_stride(bits.size)])
        counts = codec.exponent_counts(sample, dtype)
        row[: counts.size] = counts
    return row


@SETTINGS
@given(batches(), st.integers(0, 2**32 - 1), st.booleans())
def test_kept_counts_give_the_counted_patches_and_move_with_them(
    tensors: list[tuple[str, np.ndarray, np.ndarray]], seed: int, sampled: bool
) -> None:
    """Two versions of a batch, the second from the counts the first moved (known or
    not, each tensor's own): every patch is `encode_changes`' own, and the counts moved in
    place are the new tensors' counts at their sample stride. `sampled`: a tensor past
    `SAMPLE_FROM` too, whose counts are of every 32nd element."""
    if sampled:
        big = make_case(tensors[0][0], SAMPLE_FROM + 100, "small-weights", seed)
        tensors = [*tensors, (big.dtype, big.old, big.new)]
    rng = np.random.default_rng(seed)
    # a third version: some elements of the second back to the first's, some moved again
    third = []
    for dtype, old, new in tensors:
        bits = new.view(codec.uint_dtype(dtype)).copy()
        back = rng.random(bits.size) < 0.3
        bits[back] = old.view(bits.dtype)[back]
        bits[rng.random(bits.size) < 0.01] += bits.dtype.type(1)
        third.append(bits.view(np.uint8))
    columns = max(codec.EXPONENT_FIELDS.get(d, (0, 0))[1] + 1 for d, _, _ in tensors)
    counts = np.full((len(tensors), columns), -1, dtype=np.int64)
    for step, versions in enumerate(
        ([(d, o, n) for d, o, n in tensors], [(d, n, t) for (d, _, n), t in zip(tensors, third, strict=True)])
    ):
        changes = [codec.diff(old, new, dtype) for dtype, old, new in versions]
        digests = [codec.digest(old, dtype) for dtype, old, _ in versions]
        buffer, starts = one_buffer(versions, 1)
        if step == 0:  # some counts known from the start, the others counted
            for i in range(0, len(versions), 2):
                counts[i] = sampled_counts(versions[i][1], versions[i][0], columns)
        got = codec.encode_batch(changes, digests, old=buffer, old_starts=starts, counts=counts)
        for (dtype, old, new), c, d, (patch, _), row in zip(
            versions, changes, digests, got, counts, strict=True
        ):
            assert patch == codec.encode_changes(c, old, dtype, old_digest=d)
            if row[0] >= 0:  # moved in place
                mask = codec.EXPONENT_FIELDS[dtype][1]
                assert np.array_equal(row[: mask + 1], sampled_counts(new, dtype, columns)[: mask + 1])


@SETTINGS
@given(st.sampled_from(["BF16", "F16", "F32", "F8_E4M3"]), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_given_hints_are_used_as_given(dtype: str, count: int, seed: int) -> None:
    """The device's hints (here the host's own, and one tensor without) give the patches
    `encode_changes` gives with them."""
    cases = [make_case(dtype, 2000 + 37 * i, "small-weights", seed + i) for i in range(count)]
    changes = [codec.diff(c.old, c.new, dtype) for c in cases]
    hints = [
        codec.context_hint(ch, c.old.view(codec.uint_dtype(dtype))) if i else None
        for i, (c, ch) in enumerate(zip(cases, changes, strict=True))
    ]
    digests = [codec.digest(c.old, dtype) for c in cases]
    got = codec.encode_batch(changes, digests, hints=hints)
    for c, ch, d, h, (patch, _) in zip(cases, changes, digests, hints, got, strict=True):
        assert patch == codec.encode_changes(ch, None, dtype, old_digest=d, hint=h)
        assert codec.apply(c.old, patch).tobytes() == c.new.tobytes()


def test_bad_input_is_refused_as_encode_changes_refuses_it() -> None:
    case = make_case("BF16", 500, "ulp", 1)
    good = codec.diff(case.old, case.new, "BF16")
    digest = codec.digest(case.old, "BF16")
    unsorted = codec.Changes("BF16", good.numel, good.positions[::-1].copy(), good.old_bits, good.new_bits)
    with pytest.raises(codec.PatchError, match="strictly increasing"):
        codec.encode_batch([good, unsorted], [digest, digest])
    outside = codec.Changes("BF16", 3, good.positions, good.old_bits, good.new_bits)
    with pytest.raises(codec.PatchError, match="outside"):
        codec.encode_batch([outside], [digest])
    with pytest.raises(codec.PatchError, match="fewer than"):
        codec.encode_batch([good], [digest], old=case.old, old_starts=[1])
    wrong = codec.ContextHint(0, 300, np.zeros(good.count, dtype=np.int64))
    with pytest.raises(codec.PatchError, match="bad thresholds"):
        codec.encode_batch([good], [digest], hints=[wrong])
    with pytest.raises(codec.PatchError, match="one element width"):
        f32 = make_case("F32", 10, "one", 1)
        codec.encode_batch([good, codec.diff(f32.old, f32.new, "F32")], [digest, digest])
    # the batch parses its base digests in one call: each bad one refused as `encode_changes` does
    for bad in (digest[:-1], "z" + digest[1:], digest[:4] + "  " + digest[6:]):
        with pytest.raises(codec.PatchError, match="digest"):
            codec.encode_changes(good, None, "BF16", old_digest=bad)
        with pytest.raises(codec.PatchError, match="digest"):
            codec.encode_batch([good, good], [digest, bad])


@SETTINGS
@given(
    st.lists(
        st.tuples(
            st.integers(0, 255),
            st.integers(0, len(codec.ENCODINGS) - 1),
            st.integers(0, 2**64 - 1),
            st.integers(0, 2**64 - 1),
            st.binary(min_size=16, max_size=16),
            st.binary(min_size=16, max_size=16),
            st.binary(max_size=300),
        ),
        max_size=8,
    ),
    st.binary(max_size=16),
)
def test_patches_framed_together_are_each_framed_alone(
    rows: list[tuple[int, int, int, int, bytes, bytes, bytes]], spare: bytes
) -> None:
    """`pack_many` writes what `pack_fields` writes patch by patch, end to end (payloads
    read from a buffer with spare bytes after them, as the batch encoder's is)."""
    dtypes, encodings, numels, changed, bases, results, payloads = (
        zip(*rows, strict=True) if rows else ([],) * 7
    )
    ends = np.array(list(itertools.accumulate(len(p) for p in payloads)), dtype=np.int64)
    data, patch_ends = pack_many(
        np.array(dtypes, dtype=np.uint8),
        np.array(encodings, dtype=np.int64),
        np.array(numels, dtype=np.uint64),
        np.array(changed, dtype=np.uint64),
        b"".join(bases),
        b"".join(results),
        np.frombuffer(b"".join(payloads) + spare, dtype=np.uint8),
        ends,
    )
    alone = [pack_fields(*row) for row in rows]
    assert data == b"".join(alone)
    assert patch_ends.tolist() == list(itertools.accumulate(len(p) for p in alone))
