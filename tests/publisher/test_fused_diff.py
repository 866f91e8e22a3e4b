"""The fused Triton pass gives what the torch reference gives, bit for bit.

Without CUDA the kernels run under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set here
before the kernels are built) on small CPU tensors, with small tiles so that tensors cross
tile edges; `test_fused_diff_cuda.py` repeats the comparison at full size on a GPU. Both
need Triton (skipped where it is not installed).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaboard.board import codec
from deltaboard.board.contract.schemas import ViewRule, ViewSpec
from deltaboard.publisher import device_diff, fused_diff
from deltaboard.publisher.device_diff import BatchDiff, ViewDiff
from deltaboard.publisher.snapshot import SlotBatch, ViewBuffer, ViewLayout
from tests.publisher.test_device_diff import SPEC, float_pairs, state_pairs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Triton's interpreter is chosen when Triton is imported, so before; the publisher never
    # runs the kernels on CPU tensors unless asked (`diff_slots(fused=True)`), so other
    # tests are unaffected by the variable.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")


@pytest.fixture(scope="module", params=[32, 256])
def tile(request: pytest.FixtureRequest) -> Iterator[int]:
    """Small tiles: tensors of a few hundred elements cross several tile edges."""
    saved = fused_diff.TILE
    fused_diff.TILE = request.param if DEVICE == "cpu" else saved
    yield fused_diff.TILE
    fused_diff.TILE = saved


def assert_same(reference: ViewDiff | BatchDiff, fused: ViewDiff | BatchDiff) -> None:
    """Same changed tensors with the same positions, bits and context hints."""
    assert reference.changes.keys() == fused.changes.keys()
    for name, want in reference.changes.items():
        got = fused.changes[name]
        assert (got.dtype, got.numel) == (want.dtype, want.numel)
        for field in ("positions", "old_bits", "new_bits"):
            a, b = getattr(want, field), getattr(got, field)
            assert a.dtype == b.dtype and np.array_equal(a, b), (name, field)
    assert reference.hints.keys() == fused.hints.keys()
    for name, want_hint in reference.hints.items():
        got_hint = fused.hints[name]
        assert (got_hint.t_low, got_hint.t_top) == (want_hint.t_low, want_hint.t_top)
        assert np.array_equal(got_hint.ranks, want_hint.ranks), name


def both(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    spec: ViewSpec,
    hints: bool,
    layout: ViewLayout | None = None,
) -> None:
    layout = layout or ViewLayout.of({k: v.to(DEVICE) for k, v in old.items()}, spec)
    a, b = ViewBuffer(layout), ViewBuffer(layout)
    a.fill({k: v.to(DEVICE) for k, v in old.items()})
    b.fill({k: v.to(DEVICE) for k, v in new.items()})
    # one launch per group, every slot of it at once; the layout's own batches, which the
    # expected counts of a range are kept for (`fused_diff._capacity`)
    for slots in device_diff.batches(layout, 1 << 62):
        # the torch pass itself (on CPU tensors `diff_slots` would take the codec's host diff)
        reference = device_diff._cut(slots, device_diff._find(a, b, slots, hints, False))
        assert_same(reference, device_diff.diff_slots(a, b, slots, hints=hints, fused=True))


@settings(max_examples=12, deadline=None)
@given(pair=state_pairs(), hints=st.booleans())
def test_fused_changes_match_torch_for_every_dtype(tile, pair, hints):
    """Every dtype the view supports (fp32, bf16, fp16, fp8, int64, int8, bool), ragged
    sizes (0 to 729 elements, several tensors sharing a group buffer)."""
    both(pair[0], pair[1], SPEC, hints)


@settings(max_examples=10, deadline=None)
@given(pair=float_pairs().filter(lambda p: p[0].numel() <= 5000), extra=float_pairs())
def test_fused_hints_match_torch(tile, pair, extra):
    """Changes that favour small weights, so that the classes pay off and ranks are computed;
    two tensors of possibly different dtypes and widths in one call."""
    old = {"w": pair[0], "v": extra[0][:300]}
    new = {"w": pair[1], "v": extra[1][:300]}
    both(old, new, ViewSpec(rules=(ViewRule(pattern="*", dtype="raw"),)), hints=True)


def test_many_tensors_in_one_launch_match(tile):
    """A hundred tiny tensors (some empty, some of one element) in one batch."""
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 40, (100,), generator=g).tolist()
    old = {f"t{i}": (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16) for i, n in enumerate(sizes)}
    new = {}
    for name, t in old.items():
        bits = t.clone().view(torch.int16)
        bits[torch.rand(t.numel(), generator=g) < 0.2] += 1
        new[name] = bits.view(torch.bfloat16)
    both(old, new, ViewSpec(), hints=True)


def test_a_pass_that_finds_more_than_it_made_room_for_runs_again(tile, monkeypatch):
    """The output is sized before the count is known (`fused_diff._capacity`): every element
    of a tensor changed overflows the first guess of the word pass (with hints and without:
    the hint works on its changes), which must run again, sized exactly, rather than lose
    changes; a later diff with fewer changes fits the guess its predecessor left."""
    monkeypatch.setattr(fused_diff, "_expected", {})
    g = torch.Generator().manual_seed(5)
    old = {"w": torch.randn(6000, generator=g).to(torch.bfloat16)}
    everything = {"w": (old["w"].view(torch.int16) + 1).view(torch.bfloat16)}
    layout = ViewLayout.of({k: v.to(DEVICE) for k, v in old.items()}, ViewSpec())
    for hints in (False, True):
        both(old, everything, ViewSpec(), hints=hints, layout=layout)
    # the pass counted every change in 64-bit words (4 bf16 each), for the layout's one batch
    assert list(fused_diff._expected.values()) == [6000 // 4]
    some = everything["w"].clone()
    some.view(torch.int16)[::7] += 1
    for hints in (False, True):
        both(everything, {"w": some}, ViewSpec(), hints=hints, layout=layout)
    # the same range's count, now what the later diffs found
    (later,) = fused_diff._expected.values()
    assert 0 < later < 6000 // 4


def test_expected_counts_of_layouts_no_longer_diffed_are_forgotten_oldest_first(tile, monkeypatch):
    """A range's expected count is kept per batch, which is equal only to itself: past
    `_EXPECTED_KEYS` ranges the oldest go, so that publishers made again and again for the
    same model do not grow the table for the process' life."""
    monkeypatch.setattr(fused_diff, "_expected", {})
    monkeypatch.setattr(fused_diff, "_EXPECTED_KEYS", 2)
    old = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    new = {"w": torch.ones(64, dtype=torch.bfloat16)}
    layouts = [ViewLayout.of({k: v.to(DEVICE) for k, v in old.items()}, ViewSpec()) for _ in range(3)]
    for layout in layouts:
        both(old, new, ViewSpec(), hints=False, layout=layout)
    kept = [("words", batch) for layout in layouts[1:] for batch in device_diff.batches(layout, 1 << 62)]
    assert list(fused_diff._expected) == kept


def test_batches_whose_passes_start_a_batch_early_match_the_host_diff(tile, monkeypatch):
    """`iter_diffs` queues each batch's fused pass (its first half) before it waits for the
    counts of the batch before (`ChangedElements`): many batches of bf16 and fp32 tensors,
    one of which overflows its first guess after the next batch's pass was queued, give the
    codec's host diff, and every batch but the first of each group was started early."""
    monkeypatch.setattr(device_diff, "BATCH_SLOTS", 2)
    monkeypatch.setattr(fused_diff, "_expected", {})
    events: list[tuple[str, str]] = []
    begin, result = device_diff._begin_fused, fused_diff.ChangedElements.result

    first_names: dict[int, str] = {}

    def begun(old: ViewBuffer, new: ViewBuffer, slots: SlotBatch) -> fused_diff.ChangedElements:
        events.append(("begin", slots[0].name))
        elements = begin(old, new, slots)
        first_names[id(elements)] = slots[0].name
        return elements

    def waited(self: fused_diff.ChangedElements) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        events.append(("result", first_names[id(self)]))
        return result(self)

    monkeypatch.setattr(device_diff, "_begin_fused", begun)
    monkeypatch.setattr(fused_diff.ChangedElements, "result", waited)
    g = torch.Generator().manual_seed(11)
    sizes = [300, 7, 520, 0, 64, 1000, 33, 410, 5]
    old = {f"t{i}": torch.randn(n, generator=g) * 1e-2 for i, n in enumerate(sizes)}
    old.update(
        {f"b{i}": (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16) for i, n in enumerate(sizes)}
    )
    versions = [old]
    for everything in (None, "b5"):  # then every element of one tensor in a middle batch
        new = {}
        for name, t in versions[-1].items():
            bits = t.clone().view(torch.int32 if t.dtype == torch.float32 else torch.int16)
            bits[torch.rand(t.numel(), generator=g) < (1.0 if name == everything else 0.05)] += 1
            new[name] = bits.view(t.dtype)
        versions.append(new)
    fp32 = ViewSpec(rules=(ViewRule(pattern="t*", dtype="fp32"),))
    layout = ViewLayout.of({k: v.to(DEVICE) for k, v in old.items()}, fp32)
    batches = device_diff.batches(layout, device_diff.batch_bytes_for(layout))
    for before, after in itertools.pairwise(versions):
        a, b = ViewBuffer(layout), ViewBuffer(layout)
        a.fill({k: v.to(DEVICE) for k, v in before.items()})
        b.fill({k: v.to(DEVICE) for k, v in after.items()})
        events.clear()
        got = device_diff.diff_views(a, b, hints=False, fused=True)
        assert got.changes.keys() == {n for n in before if not torch.equal(before[n], after[n])}
        for name, changes in got.changes.items():
            raw = [v[name].view(torch.uint8).numpy() for v in (before, after)]
            want = codec.diff(raw[0], raw[1], changes.dtype)
            for field in ("positions", "old_bits", "new_bits"):
                assert np.array_equal(getattr(changes, field), getattr(want, field)), (name, field)
        # within a group, each batch's pass was queued before the host waited for the last's
        for first, second in itertools.pairwise(batches):
            if first[0].group == second[0].group:
                assert events.index(("begin", second[0].name)) < events.index(("result", first[0].name))


def test_the_compaction_kernels_compile_once_whatever_the_capacity() -> None:
    """The output's capacity is sized from the last pass, so it varies from version to
    version; Triton would compile another variant whenever its divisibility by 16 did."""
    from deltaboard.publisher import fused_kernels
    from tests.support.triton_kernels import unspecialized

    assert "capacity" in unspecialized(fused_kernels.compact_words)
    # the changed word count (or a capacity) the split kernels and the reorder take varies too
    assert "capacity" in unspecialized(fused_kernels.lane_counts)
    assert "m" in unspecialized(fused_kernels.split_words)
    assert "bound" in unspecialized(fused_kernels.reorder)


def _buffers(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], spec: ViewSpec
) -> tuple[ViewBuffer, ViewBuffer]:
    layout = ViewLayout.of({k: v.to(DEVICE) for k, v in old.items()}, spec)
    a, b = ViewBuffer(layout), ViewBuffer(layout)
    a.fill({k: v.to(DEVICE) for k, v in old.items()})
    b.fill({k: v.to(DEVICE) for k, v in new.items()})
    return a, b


@settings(max_examples=8, deadline=None)
@given(pair=state_pairs(), triton_runs=st.booleans())
def test_lanes_scattered_from_positions_mark_each_change_in_its_tile(tile, pair, triton_runs):
    """`lanes_at` sets, for each change, the bit of its lane in its tile's mask words (tiles
    of `tile` elements from each slot's start), counts each tile's changes and where each
    tile's run starts: built here change by change from the torch pass' positions. By
    torch's scatters, or by one Triton launch of atomics where Triton runs."""
    a, b = _buffers(pair[0], pair[1], SPEC)
    for group in a.layout.group_numel:
        slots = [s for s in a.layout.slots if s.group == group]
        found = device_diff._cut(slots, device_diff._find(a, b, slots, False, False))
        local = [
            found.changes[s.name].positions if s.name in found.changes else np.zeros(0, np.int64)
            for s in slots
        ]
        owner = np.repeat(np.arange(len(slots)), [p.size for p in local])
        positions = np.concatenate(local).astype(np.int64)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused_diff, "available", lambda device: triton_runs)
            got = fused_diff.lanes_at(
                slots, torch.from_numpy(owner).to(DEVICE), torch.from_numpy(positions).to(DEVICE)
            )
        table = fused_diff.tiles(tuple(slots), str(DEVICE), tile)
        words = np.zeros(max(table.count, 1) * (tile // 32), dtype=np.uint32)
        counts = np.zeros(table.count, dtype=np.int64)
        for s, p in zip(owner.tolist(), positions.tolist(), strict=True):
            t = int(table.first[s]) + p // tile
            words[t * (tile // 32) + (p % tile) // 32] |= np.uint32(1 << (p % 32))
            counts[t] += 1
        assert got.tile == tile
        assert np.array_equal(got.masks.cpu().numpy().view(np.uint32), words)
        assert np.array_equal(got.tile_counts.cpu().numpy(), counts)
        assert np.array_equal(got.tile_offsets.cpu().numpy(), np.cumsum(counts) - counts)


def test_torch_hints_rank_with_the_fused_kernels_where_triton_runs(tile, monkeypatch):
    """Where Triton runs, the torch pass ranks its changes with the fused pass' rank kernels
    (the lanes scattered from its positions): the same hints as its own cumulative counts."""
    g = torch.Generator().manual_seed(11)
    # a sampled tensor (65,536 elements at least) with 256-element tiles only: in tiles of
    # 32 it is ~2,200 of them under the interpreter, 49 s of a CI core
    sizes = [5, 300, 4000, 70_000, 33] if tile == 256 or DEVICE == "cuda" else [5, 300, 4000, 33]
    old = {
        f"t{i}": (torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 1, (n,), generator=g)).to(
            torch.bfloat16
        )
        for i, n in enumerate(sizes)
    }
    new = {}
    for name, t in old.items():
        bits = t.clone().view(torch.int16)
        small = t.abs().float() < 1e-3
        bits[torch.rand(t.numel(), generator=g) < torch.where(small, 0.3, 0.01)] += 1
        new[name] = bits.view(torch.bfloat16)
    a, b = _buffers(old, new, ViewSpec())
    slots = list(a.layout.slots)
    monkeypatch.setattr(fused_diff, "available", lambda device: False)
    reference = device_diff._cut(slots, device_diff._find(a, b, slots, True, False))
    monkeypatch.setattr(fused_diff, "available", lambda device: True)
    got = device_diff._cut(slots, device_diff._find(a, b, slots, True, False))
    assert reference.hints, "the classes paid off nowhere: the ranks were not exercised"
    assert_same(reference, got)


@settings(max_examples=10, deadline=None)
@given(pair=state_pairs())
def test_hint_keys_in_one_launch_give_the_hints_torch_gives(tile, pair):
    """The context hints of every dtype's changes (floating or not, sampled or not: the
    keys of the three count tables), keyed in one Triton launch per batch with a mark for
    "no key" that is dropped on the host, equal the torch code's, whose keys are cut
    out by masks; and so do the new view's sampled counts, which the sampled changes move
    (the next version's hints start from them)."""
    a, b = _buffers(pair[0], pair[1], SPEC)
    for slots in device_diff.batches(a.layout, 1 << 40):  # the diff's own: runs of one group
        found, moved = [], []
        for triton_runs in (False, True):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(fused_diff, "available", lambda device, runs=triton_runs: runs)
                found.append(device_diff._cut(slots, device_diff._find(a, b, slots, True, False)))
                kept = b.sampled_counts
                moved.append(np.zeros((0, 0), np.int64) if kept is None else kept.table.copy())
        assert_same(*found)
        assert np.array_equal(moved[0], moved[1])


@settings(max_examples=8, deadline=None)
@given(pair=state_pairs())
def test_sampled_counts_in_one_launch_match_torch(tile, pair):
    """The first count of a tensor's sampled exponents (every 32nd element of a large one,
    every element of a small one) in one launch over the batch's tiles equals torch's."""
    a, _ = _buffers(pair[0], pair[0], SPEC)
    for group in a.layout.group_numel:
        slots = SlotBatch(s for s in a.layout.slots if s.group == group)
        floating = [i for i, s in enumerate(slots) if s.dtype in codec.EXPONENT_FIELDS]
        picked = np.array(floating, dtype=np.int64)
        bins = fused_diff.hint_bins(slots)
        counted = []
        for triton_runs in (False, True):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(fused_diff, "available", lambda device, runs=triton_runs: runs)
                counted.append(device_diff._count_sampled(a, slots, picked, bins)[0])
        assert np.array_equal(counted[0], counted[1])
        sampled = [-(-slots[i].numel // codec.sample_stride(slots[i].numel)) for i in picked.tolist()]
        assert counted[0].sum(axis=1).tolist() == sampled  # every sampled element, once
