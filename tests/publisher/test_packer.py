"""The packer places a batch of patches exactly as it would place them one at a time, and
hands back its parts as columns."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.publisher.encode import RankVersion, encode_rank
from deltaboard.publisher.manifest import Proposal, build_manifest
from deltaboard.publisher.packer import BlobPacker, PackedParts, TensorPart, Tensors
from deltaboard.publisher.snapshot import ViewBuffer, ViewLayout


def one_at_a_time(patches: list[bytes], blob_max: int) -> list[bytes]:
    """The blobs of the packing rule stated patch by patch: a patch goes to the open blob
    unless it would take it past `blob_max` (then the blob is sealed first)."""
    blobs: list[list[bytes]] = []
    size = 0
    for patch in patches:
        if not blobs or (blobs[-1] and size + len(patch) > blob_max):
            blobs.append([])
            size = 0
        blobs[-1].append(patch)
        size += len(patch)
    return [b"".join(blob) for blob in blobs]


def pack(batches: list[list[bytes]], blob_max: int) -> tuple[PackedParts, dict[str, bytes]]:
    uploaded: dict[str, bytes] = {}
    with ThreadPoolExecutor(2) as pool:
        packer = BlobPacker(uploaded.__setitem__, pool, blob_max_bytes=blob_max, max_pending_bytes=1 << 20)
        done = 0
        for batch in batches:
            tensors = Tensors(
                [f"t{done + i}" for i in range(len(batch))],
                ["BF16"] * len(batch),
                [(len(p),) for p in batch],
                list(range(len(batch))),
            )
            ends = list(itertools.accumulate(len(p) for p in batch))
            packer.add(tensors, b"".join(batch), ends, [f"d{done + i}" for i in range(len(batch))])
            done += len(batch)
        return packer.finish(), uploaded


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=60),
    st.lists(st.integers(1, 12), min_size=1),
    st.integers(1, 1000),
)
def test_a_batch_is_packed_as_its_patches_one_at_a_time(lengths: list[int], cuts: list[int], blob_max: int):
    patches = [bytes([i % 251]) * n for i, n in enumerate(lengths)]
    batches, at = [], 0
    for cut in itertools.cycle(cuts):  # the same patches handed over in batches of any size
        batches.append(patches[at : at + cut])
        at += cut
        if at >= len(patches):
            break
    parts, uploaded = pack(batches, blob_max)
    assert [uploaded[sha] for sha in parts.blobs] == one_at_a_time(patches, blob_max)
    assert len(parts) == len(patches)
    for i, (part, patch) in enumerate(zip(parts, patches, strict=True)):
        assert part == TensorPart(
            f"t{i}", "BF16", (len(patch),), part.sha256, part.offset, len(patch), f"d{i}", part.changed
        )
        assert uploaded[part.sha256][part.offset : part.offset + part.length] == patch


def test_parts_of_several_packers_are_joined_and_reordered_in_their_blobs():
    first, first_blobs = pack([[b"a" * 5, b"b" * 5], [b"c" * 5]], blob_max=10)
    second, second_blobs = pack([[b"d" * 3]], blob_max=10)
    joined = PackedParts.joined([first, second])
    assert list(joined) == [*first, *second] and len(joined.blobs) == 3
    blobs = {**first_blobs, **second_blobs}
    reordered = joined.take([3, 0, 2])
    assert [p.name for p in reordered] == ["t0", "t0", "t2"]
    assert [blobs[p.sha256][p.offset : p.offset + p.length] for p in reordered] == [
        b"ddd",
        b"a" * 5,
        b"c" * 5,
    ]


def test_blobs_of_the_same_bytes_are_one_blob_of_the_manifest():
    """Identical tensors, each past `blob_max_bytes`, seal two blobs of the same bytes: the
    manifest names that sha256 once (it refuses a blob named twice)."""
    x = torch.randn(4096)
    state = {"a": x.clone(), "b": x.clone()}
    spec = ViewSpec()
    buffer = ViewBuffer(ViewLayout.of(state, spec))
    buffer.fill(state)
    uploaded: dict[str, bytes] = {}
    with ThreadPoolExecutor(2) as uploads, ThreadPoolExecutor(2) as encoders:
        packer = BlobPacker(uploaded.__setitem__, uploads, blob_max_bytes=2000, max_pending_bytes=1 << 24)
        version = encode_rank(buffer, None, {}, packer, encoders, window=4)
    assert len(version.parts.blobs) == 2 and len(set(version.parts.blobs)) == 1
    manifest = build_manifest("run", Proposal(0, "full", None, {}), spec, 1, [version])
    assert [e.blob.sha256 for e in manifest.tensors] == version.parts.blobs


def test_the_manifest_can_be_made_while_the_last_blob_uploads():
    """`encode_rank` hands the version to `while_uploading` once its blobs are sealed, before
    their uploads end, and returns it once they have: the upload here waits for the call
    (a call after the uploads would find the upload given up), and a failed upload still
    fails the version after the call."""
    state = {"a": torch.randn(4096), "b": torch.randn(300)}
    spec = ViewSpec()
    buffer = ViewBuffer(ViewLayout.of(state, spec))
    buffer.fill(state)
    called = threading.Event()
    seen: list[bool] = []

    def upload(sha: str, data: bytes) -> None:
        seen.append(called.wait(10))

    def made(version: RankVersion) -> None:
        assert not seen  # no upload has ended yet
        build_manifest("run", Proposal(0, "full", None, {}), spec, 1, [version])
        called.set()

    with ThreadPoolExecutor(2) as uploads, ThreadPoolExecutor(2) as encoders:
        packer = BlobPacker(upload, uploads, blob_max_bytes=1 << 20, max_pending_bytes=1 << 24)
        version = encode_rank(buffer, None, {}, packer, encoders, window=4, while_uploading=made)
        assert seen == [True] and len(version.parts.blobs) == 1

        def failing(sha: str, data: bytes) -> None:
            called.wait(10)
            raise OSError("link down")

        called.clear()
        packer = BlobPacker(failing, uploads, blob_max_bytes=1 << 20, max_pending_bytes=1 << 24)
        with pytest.raises(OSError, match="link down"):
            encode_rank(buffer, None, {}, packer, encoders, window=4, while_uploading=lambda _: called.set())
