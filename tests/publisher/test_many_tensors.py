"""A model of thousands of small tensors goes through the publisher's stages in batches."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from deltaboard.board import codec
from deltaboard.board.contract.schemas import Manifest, TensorTable, ViewSpec
from deltaboard.publisher import device_diff, encode
from deltaboard.publisher.encode import BUNDLE_ELEMENTS, encode_rank
from deltaboard.publisher.manifest import Proposal, build_manifest
from deltaboard.publisher.packer import BlobPacker
from deltaboard.publisher.snapshot import ViewBuffer, ViewLayout


class CountingPool(ThreadPoolExecutor):
    """A real thread pool that counts the tasks handed to it."""

    def __init__(self) -> None:
        super().__init__(2)
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def _stepped_views(
    tensors: int, numel: int, rate: float, seed: int
) -> tuple[ViewLayout, ViewBuffer, ViewBuffer]:
    """A view of `tensors` small bf16 tensors and the view after a step that moves about
    `rate` of their elements by one ULP: (layout, old view, new view)."""
    g = torch.Generator().manual_seed(seed)
    old = {f"t{i}": (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16) for i in range(tensors)}
    new = {}
    for name, t in old.items():
        bits = t.clone().view(torch.int16)
        bits[torch.rand(numel, generator=g) < rate] += 1
        new[name] = bits.view(torch.bfloat16)
    layout = ViewLayout.of(old, ViewSpec())
    base, buffer = ViewBuffer(layout), ViewBuffer(layout)
    base.fill(old)
    buffer.fill(new)
    return layout, base, buffer


def test_small_tensors_are_encoded_in_bundles_with_the_same_patches(monkeypatch):
    """One encoder task and one codec call per bundle; each patch what `encode_changes`
    writes for its tensor alone."""
    batches: list[int] = []
    encode_batch = codec.encode_batch

    def counted(changes: Any, *args: Any, **kwargs: Any) -> Any:
        batches.append(len(changes))
        return encode_batch(changes, *args, **kwargs)

    monkeypatch.setattr(codec, "encode_batch", counted)
    layout, base, buffer = _stepped_views(3000, 500, 0.02, seed=0)
    blobs: dict[str, bytes] = {}
    digests = {s.name: codec.digest(base.host_bytes(s), s.dtype) for s in layout.slots}
    pool = CountingPool()
    with ThreadPoolExecutor(2) as uploads, pool:
        packer = BlobPacker(blobs.__setitem__, uploads, blob_max_bytes=1 << 20, max_pending_bytes=1 << 24)
        version = encode_rank(buffer, base, digests, packer, pool, window=4)
    changed = version.changed_elements
    assert len(version.parts) == 3000 > changed // BUNDLE_ELEMENTS + 2 >= pool.submitted
    assert len(batches) == pool.submitted and sum(batches) == 3000
    for part, slot in zip(version.parts, layout.slots, strict=True):
        assert part.name == slot.name
        blob = blobs[part.sha256][part.offset : part.offset + part.length]
        assert np.array_equal(codec.apply(base.host_bytes(slot), blob), buffer.host_bytes(slot))
        old_bytes, new_bytes = base.host_bytes(slot), buffer.host_bytes(slot)
        alone = codec.encode_changes(
            codec.diff(old_bytes, new_bytes, slot.dtype), old_bytes, slot.dtype, old_digest=digests[slot.name]
        )
        assert blob == alone


def test_a_manifest_of_many_entries_is_what_its_json_reads_back():
    """Entries are validated once with the whole manifest: the same bytes a per-entry build
    gave, every entry in its planned shard file."""
    g = torch.Generator().manual_seed(1)
    state = {f"layers.{i}.w": torch.randn(int(n), generator=g) for i, n in enumerate(range(1, 2001))}
    layout = ViewLayout.of(state, ViewSpec(shard_max_bytes=1 << 20))
    buffer = ViewBuffer(layout)
    buffer.fill(state)
    blobs: dict[str, bytes] = {}
    with ThreadPoolExecutor(2) as uploads, ThreadPoolExecutor(2) as encoders:
        packer = BlobPacker(blobs.__setitem__, uploads, blob_max_bytes=1 << 20, max_pending_bytes=1 << 24)
        version = encode_rank(buffer, None, {}, packer, encoders, window=4)
    spec = ViewSpec(shard_max_bytes=1 << 20)
    manifest = build_manifest("run", Proposal(0, "full", None, {}), spec, 1, [version])
    text = manifest.model_dump_json()
    read = Manifest.model_validate_json(text)
    assert read.model_dump_json() == text
    # the columns, taken as built, hold what validating them gives (tuples, ints, strings)
    assert read == manifest
    assert TensorTable.of(read.tensors).columns == TensorTable.of(manifest.tensors).columns
    files = [e.file for e in manifest.tensors]
    assert len(set(files)) > 1 and files == sorted(files)  # shards in order, several of them


@pytest.mark.parametrize("name", ["", "x" * 513])
def test_a_tensor_name_the_manifest_cannot_carry_is_refused_by_the_publisher(name: str):
    """The entries are not validated again per version, but the caller's names (and dtypes,
    shapes, files) are, once per set of tensors: a name the schema refuses fails the build
    of the manifest, as it did when every entry was validated, not the board's commit."""
    state = {"ok": torch.zeros(4), name: torch.zeros(4)}
    spec = ViewSpec()
    buffer = ViewBuffer(ViewLayout.of(state, spec))
    buffer.fill(state)
    with ThreadPoolExecutor(2) as uploads, ThreadPoolExecutor(2) as encoders:
        packer = BlobPacker(lambda _, __: None, uploads, blob_max_bytes=1 << 20, max_pending_bytes=1 << 24)
        version = encode_rank(buffer, None, {}, packer, encoders, window=4)
    with pytest.raises(ValidationError):
        build_manifest("run", Proposal(0, "full", None, {}), spec, 1, [version])


def test_the_next_diff_batch_is_bundled_while_the_encoders_run_the_last(monkeypatch):
    """The encoders get the next diff batch's bundles while the last batch's still run:
    every bundle is packed with the window full, not only those inside one diff batch
    (a model of many small tensors would leave the encoders waiting at every batch while
    its changes are gathered and bundled)."""
    monkeypatch.setattr(device_diff, "CPU_BATCH_BYTES", 20_000)  # ~20 batches of 10 tensors
    monkeypatch.setattr(encode, "BUNDLE_ELEMENTS", 30)  # ~3 bundles a batch
    layout, base, buffer = _stepped_views(200, 1000, 0.01, seed=2)
    digests = {s.name: codec.digest(base.host_bytes(s), s.dtype) for s in layout.slots}
    blobs: dict[str, bytes] = {}
    pool = CountingPool()
    in_flight: list[int] = []  # bundles handed to the encoders and not yet packed, at each pack
    with ThreadPoolExecutor(2) as uploads, pool:
        packer = BlobPacker(blobs.__setitem__, uploads, blob_max_bytes=1 << 20, max_pending_bytes=1 << 24)
        add = packer.add

        def counted_add(*args: Any) -> None:
            in_flight.append(pool.submitted - len(in_flight))
            add(*args)

        monkeypatch.setattr(packer, "add", counted_add)
        version = encode_rank(buffer, base, digests, packer, pool, window=4)
    assert len(device_diff.batches(layout, device_diff.CPU_BATCH_BYTES)) > 10
    assert len(in_flight) == pool.submitted > 30
    assert in_flight[:-3] == [4] * (len(in_flight) - 3)  # then the last three drain
    for part, slot in zip(version.parts, layout.slots, strict=True):
        blob = blobs[part.sha256][part.offset : part.offset + part.length]
        assert np.array_equal(codec.apply(base.host_bytes(slot), blob), buffer.host_bytes(slot))


def test_a_batch_holds_at_most_batch_slots_tensors_of_one_group_in_layout_order(monkeypatch):
    """However large the batch's bytes, a model of many small tensors is cut into batches of
    at most `BATCH_SLOTS` slots (so that the encoders start on the first while the next is
    diffed), each of one group, together every slot once, in the layout's order."""
    monkeypatch.setattr(device_diff, "BATCH_SLOTS", 7)
    state = {f"t{i}": torch.zeros(5, dtype=torch.bfloat16 if i % 25 else torch.int32) for i in range(60)}
    layout = ViewLayout.of(state, ViewSpec())
    assert len(layout.group_numel) == 2  # two element widths: two groups, interleaved
    got = device_diff.batches(layout, 1 << 30)
    assert [s for batch in got for s in batch] == list(layout.slots)
    assert all(0 < len(batch) <= 7 and len({s.group for s in batch}) == 1 for batch in got)
    assert len(got) > 60 // 7


@given(st.lists(st.integers(0, 3 * BUNDLE_ELEMENTS), max_size=60), st.sampled_from([1, 30, BUNDLE_ELEMENTS]))
def test_bundles_cut_consecutive_items_where_their_work_reaches_a_bundle(
    work: list[int], bundle: int
) -> None:
    """Every item in exactly one bundle, in order; every bundle but the last holds at least
    `BUNDLE_ELEMENTS` of work and would not without its last item; the last holds less
    unless it ends exactly where its work was reached."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(encode, "BUNDLE_ELEMENTS", bundle)
        ranges = encode._bundles(work)
    assert [i for a, b in ranges for i in range(a, b)] == list(range(len(work)))
    assert all(b > a for a, b in ranges)
    for n, (a, b) in enumerate(ranges):
        held = sum(work[a:b])
        if n < len(ranges) - 1 or held >= bundle:
            assert held >= bundle and held - work[b - 1] < bundle
