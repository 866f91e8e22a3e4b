"""Exponent counts kept with a view buffer give every delta the patches counted afresh."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from deltaboard.board import codec
from deltaboard.board.contract.schemas import ViewRule, ViewSpec
from deltaboard.publisher.encode import RankVersion, encode_rank
from deltaboard.publisher.exponents import ExponentCounts
from deltaboard.publisher.packer import BlobPacker
from deltaboard.publisher.snapshot import ViewBuffer, ViewLayout

SPEC = ViewSpec(rules=(ViewRule(pattern="f16", dtype="fp16"), ViewRule(pattern="f32", dtype="fp32")))


def state_at(version: int) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and sizes (one past the sampled size, one whose version 2
    changes more than 1/8 of it, ints beside bf16 in one width), each version a few ULPs
    further: the same for a version whoever asks."""
    g = torch.Generator().manual_seed(7)
    shapes = {"small": (300,), "wide": (40, 50), "sampled": (70_000,), "busy": (256,), "f16": (900,)}
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        dtype = torch.float16 if name == "f16" else torch.bfloat16
        out[name] = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    out["f32"] = torch.randn(1000, generator=g) * 0.02
    out["ints"] = torch.randint(-1000, 1000, (500,), generator=g, dtype=torch.int16)
    for v in range(1, version + 1):
        for name, t in out.items():
            bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
            p = 0.5 if name == "busy" and v == 2 else 0.02
            bits[torch.rand(t.shape, generator=g) < p] += 1 + v % 3
    return out


def encode(
    buffer: ViewBuffer, base: ViewBuffer | None, digests: dict[str, str]
) -> tuple[RankVersion, dict[str, bytes]]:
    """One version of `buffer` against `base` (None: a keyframe), and the blobs it uploaded."""
    blobs: dict[str, bytes] = {}
    with ThreadPoolExecutor(2) as uploads, ThreadPoolExecutor(2) as encoders:
        packer = BlobPacker(blobs.__setitem__, uploads, blob_max_bytes=1 << 20, max_pending_bytes=1 << 24)
        return encode_rank(buffer, base, digests, packer, encoders, window=4), blobs


def fresh_counts(buffer: ViewBuffer) -> ExponentCounts:
    """Every tensor's counts, counted from the buffer's bytes."""
    slots = buffer.layout.slots
    counts = ExponentCounts((s.name, s.dtype) for s in slots)
    counts.count([s.name for s in slots], [(buffer.host_bytes(s), s.dtype) for s in slots])
    return counts


@pytest.mark.parametrize("failed", [False, True])
def test_each_delta_from_kept_counts_is_each_tensors_own_patch(failed: bool) -> None:
    """A keyframe, then deltas, each buffer becoming the next base as the pipeline does: every
    patch is `encode_changes`' for its tensor alone, and the counts left with each view are
    its own counted afresh. `failed`: version 2 is encoded and then dropped (its commit
    failed), so the base whose counts it moved is encoded against again."""
    layout = ViewLayout.of(state_at(0), SPEC)
    buffers = [ViewBuffer(layout) for _ in range(3)]
    base = buffers[0]
    base.fill(state_at(0))
    first, _ = encode(base, None, {})
    digests = dict(first.digests)
    versions = [1, 2, 2, 3] if failed else [1, 2, 3]
    for i, v in enumerate(versions):
        buffer = next(b for b in buffers if b is not base)
        buffer.fill(state_at(v))
        assert buffer.exponent_counts is None  # the copy replaced what they counted
        kept_before = base.exponent_counts is not None
        version, blobs = encode(buffer, base, digests)
        assert kept_before == (not failed or i != 2)  # a dropped version took the base's
        for part in version.parts:
            slot = next(s for s in layout.slots if s.name == part.name)
            old, new = base.host_bytes(slot), buffer.host_bytes(slot)
            alone = codec.encode_changes(
                codec.diff(old, new, slot.dtype), old, slot.dtype, old_digest=digests[slot.name]
            )
            assert blobs[part.sha256][part.offset : part.offset + part.length] == alone
        kept, want = buffer.exponent_counts, fresh_counts(buffer)
        assert kept is not None
        for slot in layout.slots:
            row = kept.take([slot.name])[0]
            if row[0] >= 0:  # the columns of its exponent field
                field = codec.EXPONENT_FIELDS[slot.dtype][1] + 1
                assert np.array_equal(row[:field], want.take([slot.name])[0][:field])
            else:  # counted when next needed: not floating, dense enough to skip the hint, or
                # unchanged since the base lost its counts
                assert slot.name in ("ints", "busy") or (failed and i == 2)
        if failed and i == 1:
            continue  # dropped: the base stays
        base, digests = buffer, dict(version.digests)


def test_no_counts_are_kept_without_the_context_encoding() -> None:
    layout = ViewLayout.of(state_at(0), SPEC)
    base, buffer = ViewBuffer(layout), ViewBuffer(layout)
    base.fill(state_at(0))
    blobs: dict[str, bytes] = {}
    with ThreadPoolExecutor(2) as uploads, ThreadPoolExecutor(2) as encoders:
        packer = BlobPacker(blobs.__setitem__, uploads, blob_max_bytes=1 << 20, max_pending_bytes=1 << 24)
        first = encode_rank(base, None, {}, packer, encoders, window=4, context=False)
        buffer.fill(state_at(1))
        packer = BlobPacker(blobs.__setitem__, uploads, blob_max_bytes=1 << 20, max_pending_bytes=1 << 24)
        encode_rank(buffer, base, first.digests, packer, encoders, window=4, context=False)
    assert base.exponent_counts is None and buffer.exponent_counts is None


def test_rows_put_are_the_rows_taken_whether_or_not_they_are_consecutive() -> None:
    """A bundle's rows are read and written as one block where they are consecutive in their
    width's table, row by row where they are not: either way `put` replaces exactly the
    rows of its names, and `take` gives them back."""
    names = [f"t{i}" for i in range(12)]
    counts = ExponentCounts([(n, "BF16") for n in names] + [("wide", "F32")])
    rng = np.random.default_rng(3)
    table = rng.integers(0, 1000, (12, 256))
    counts.put(names, table)
    for picked in ([2, 3, 4, 5], [0, 3, 7, 8, 11], [9], [5, 4]):
        rows = rng.integers(0, 1000, (len(picked), 256))
        counts.put([names[i] for i in picked], rows)
        table[picked] = rows
        assert np.array_equal(counts.take(names), table)
        assert np.array_equal(counts.take([names[i] for i in picked]), rows)
