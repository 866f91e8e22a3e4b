"""Wrong bases, corrupted, truncated and arbitrary patches are refused with PatchError."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.board import codec
from deltaboard.board.codec import zstd
from deltaboard.board.codec.header import HEADER_SIZE, pack, unpack
from tests.board.codec_cases import Case, make_case

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def patches() -> list[tuple[Case, bytes]]:
    out = []
    for dtype, pattern in (("BF16", "small-weights"), ("BF16", "ulp"), ("F32", "stripes"), ("I64", "all")):
        case = make_case(dtype, 20_000, pattern, seed=5)
        out.append((case, codec.encode(case.old, case.new, dtype)))
    case = make_case("F16", 3000, "random", seed=6)
    out.append((case, codec.encode(None, case.new, "F16")))
    return out


PATCHES = patches()


def outcome(old: np.ndarray | None, patch: bytes, expected: np.ndarray) -> None:
    """Either a PatchError or, if the damage was in bits nobody reads, the exact result."""
    try:
        out = codec.apply(old, patch)
    except codec.PatchError:
        return
    assert out.tobytes() == expected.tobytes()


@SETTINGS
@given(st.sampled_from(PATCHES), st.data())
def test_truncated_patches_are_refused(item: tuple[Case, bytes], data: st.DataObject) -> None:
    case, patch = item
    cut = data.draw(st.integers(0, len(patch) - 1))
    with pytest.raises(codec.PatchError):
        codec.apply(case.old, patch[:cut])
    with pytest.raises(codec.PatchError):
        codec.read_header(patch[:cut])


@SETTINGS
@given(st.sampled_from(PATCHES), st.data())
def test_flipped_bits_are_caught_by_the_checksum(item: tuple[Case, bytes], data: st.DataObject) -> None:
    case, patch = item
    i = data.draw(st.integers(0, len(patch) - 1))
    bit = data.draw(st.integers(0, 7))
    damaged = bytearray(patch)
    damaged[i] ^= 1 << bit
    with pytest.raises(codec.PatchError):
        codec.apply(case.old, bytes(damaged))


@SETTINGS
@given(st.sampled_from(PATCHES), st.data())
def test_resealed_payload_damage_never_crashes(item: tuple[Case, bytes], data: st.DataObject) -> None:
    """Damage behind a valid checksum reaches the decoders: they must refuse it cleanly."""
    case, patch = item
    header, payload = unpack(patch)
    body = bytearray(payload)
    if body:
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(body) - 1))
            body[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    outcome(case.old, pack(header, bytes(body[:cut])), case.new)


@SETTINGS
@given(st.sampled_from(PATCHES), st.data())
def test_resealed_header_damage_never_crashes(item: tuple[Case, bytes], data: st.DataObject) -> None:
    case, patch = item
    header, payload = unpack(patch)
    field = data.draw(st.sampled_from(["dtype", "numel", "encoding", "changed", "base", "result"]))
    if field == "dtype":
        header = dataclasses.replace(header, dtype=data.draw(st.sampled_from(list(codec.WIDTHS))))
    elif field == "numel":
        header = dataclasses.replace(header, numel=data.draw(st.integers(0, 2**40)))
    elif field == "encoding":
        header = dataclasses.replace(header, encoding=data.draw(st.sampled_from(codec.ENCODINGS)))
    elif field == "changed":
        header = dataclasses.replace(header, changed=data.draw(st.integers(0, header.numel)))
    elif field == "base" and header.base_digest is not None:
        header = dataclasses.replace(header, base_digest=f"{data.draw(st.integers(0, 2**128 - 1)):032x}")
    elif field == "result":
        header = dataclasses.replace(header, result_digest=f"{data.draw(st.integers(0, 2**128 - 1)):032x}")
    if header.encoding == "keyframe":
        header = dataclasses.replace(header, base_digest=None)
    elif header.base_digest is None:
        header = dataclasses.replace(header, base_digest=codec.digest(case.old, case.dtype))
    outcome(case.old, pack(header, bytes(payload)), case.new)


@SETTINGS
@given(st.binary(max_size=400))
def test_arbitrary_bytes_are_refused(data: bytes) -> None:
    old = np.zeros(64, dtype=np.uint8)
    with pytest.raises(codec.PatchError):
        codec.apply(old, data)
    with pytest.raises(codec.PatchError):
        codec.apply(old, b"DBPT\x01" + data)


def test_wrong_base_is_refused() -> None:
    case, patch = PATCHES[0]
    other = case.old.copy()
    other[10] ^= 1
    with pytest.raises(codec.PatchError, match="wrong base"):
        codec.apply(other, patch)
    with pytest.raises(codec.PatchError, match="wrong base"):
        codec.apply(case.old, patch, old_digest=codec.digest(other, case.dtype))
    with pytest.raises(codec.PatchError, match="wrong base"):
        codec.decode(patch, other)


def test_wrong_size_is_refused() -> None:
    case, patch = PATCHES[0]
    with pytest.raises(codec.PatchError, match="wrong base"):
        codec.apply(case.old[:-2], patch)
    with pytest.raises(codec.PatchError):
        codec.apply(case.old[:-1], patch)  # not a whole number of BF16 elements
    with pytest.raises(codec.PatchError):
        codec.apply(None, patch)


def test_bad_inputs_to_the_encoder() -> None:
    a = np.zeros(8, dtype=np.uint8)
    with pytest.raises(codec.PatchError, match="unsupported dtype"):
        codec.encode(a, a, "F128")
    with pytest.raises(codec.PatchError):
        codec.encode(a, np.zeros(6, dtype=np.uint8), "BF16")
    with pytest.raises(codec.PatchError):
        codec.encode(a.astype(np.int16), a.astype(np.int16), "BF16")
    bad = codec.Changes("BF16", 4, np.array([3, 1]), np.zeros(2, np.uint16), np.ones(2, np.uint16))
    with pytest.raises(codec.PatchError, match="increasing"):
        codec.encode_changes(bad, a, "BF16")


def test_a_huge_declared_size_allocates_nothing_like_it() -> None:
    """A keyframe declaring 2**40 elements is refused without allocating them."""
    case = make_case("BF16", 1000, "none", seed=1)
    header, payload = unpack(codec.encode(None, case.new, "BF16"))
    forged = pack(dataclasses.replace(header, numel=2**40, changed=2**40), bytes(payload))
    tracemalloc.start()
    try:
        with pytest.raises(codec.PatchError):
            codec.apply(None, forged)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20
    assert len(forged) > HEADER_SIZE


def test_a_frame_without_its_size_cannot_claim_more_than_zstd_codes() -> None:
    """A frame that does not declare its content size still bounds what a header may
    make the decoder allocate: zstd's densest coding is 4 bytes per 128 KiB."""
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(4000))
    assert zstandard.frame_content_size(frame) == -1
    with pytest.raises(codec.PatchError, match="cannot hold"):
        zstd.decompress_exact(frame, 2**40)
    assert zstd.decompress_exact(frame, 4000).tobytes() == bytes(4000)


def test_impossible_context_hints_are_refused():
    """A hint from elsewhere (the publisher's device) is checked before it is coded."""
    case = make_case("BF16", 20_000, "small-weights", seed=7)
    old_bits = case.old.view(codec.uint_dtype("BF16"))
    changes = codec.diff(case.old, case.new, "BF16")
    hint = codec.context_hint(changes, old_bits)
    assert hint is not None and changes.count > 2
    base = codec.digest(case.old, "BF16")
    patch = codec.encode_changes(changes, None, "BF16", old_digest=base, hint=hint)
    assert codec.apply(case.old, patch).tobytes() == case.new.tobytes()
    reversed_ranks = hint.ranks[::-1].copy()
    for bad in (
        dataclasses.replace(hint, t_low=hint.t_top + 1),
        dataclasses.replace(hint, t_top=1000),
        dataclasses.replace(hint, ranks=hint.ranks[1:]),
        dataclasses.replace(hint, ranks=reversed_ranks),
        dataclasses.replace(hint, ranks=hint.ranks - 1 - int(hint.ranks.max())),
        dataclasses.replace(hint, ranks=hint.ranks + changes.numel),
    ):
        with pytest.raises(codec.PatchError, match="context hint"):
            codec.encode_changes(changes, None, "BF16", old_digest=base, hint=bad)
