"""Tensors in parts (docs/contract.md, "Parts"): slice digests at global positions combine
into the tensor's digest, and the manifest rules refuse parts that overlap, leave their
tensor, disagree, or (in a keyframe) do not cover it."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaboard.board import codec
from deltaboard.board.contract.errors import BadManifest
from deltaboard.board.contract.manifest_rules import check_manifest
from deltaboard.board.contract.schemas import Manifest, TensorEntry, TensorPart
from tests.board.test_manifest_rules import build


def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


@settings(deadline=None, max_examples=60)  # the first example compiles the digest kernels
@given(
    st.lists(st.integers(1, 7), min_size=1, max_size=3),
    st.integers(1, 4),
    st.integers(0, 2),
    st.randoms(use_true_random=False),
)
def test_slice_digests_combine_into_the_tensor_digest(shape, pieces, dim, rnd):
    """Cut along any dimension (uneven, empty slices allowed): the slices' digests at
    global positions add up to the whole tensor's, and a slice's changes moved to global
    positions update it as the whole tensor's would move."""
    dim %= len(shape)
    data = np.array([rnd.getrandbits(16) for _ in range(math.prod(shape))], dtype=np.uint16).reshape(shape)
    cuts = sorted(rnd.randint(0, shape[dim]) for _ in range(pieces - 1))
    bounds = [0, *cuts, shape[dim]]
    digests = []
    for lo, hi in itertools.pairwise(bounds):
        box = data[(slice(None),) * dim + (slice(lo, hi),)]
        offset = tuple(lo if d == dim else 0 for d in range(len(shape)))
        digests.append(codec.digest_slice(_bytes(box), "BF16", offset, box.shape, shape))
        if box.size:  # flip the box's last element: the global digest moves with the whole tensor's
            new = box.copy()
            new.reshape(-1)[-1] ^= 1
            local = codec.diff(_bytes(box), _bytes(new), "BF16")
            at = codec.slice_positions(local.positions, offset, box.shape, shape)
            moved = codec.Changes("BF16", data.size, at, local.old_bits, local.new_bits)
            whole = data.copy()
            whole.reshape(-1)[at] = local.new_bits
            before, after = codec.digest(_bytes(data), "BF16"), codec.digest(_bytes(whole), "BF16")
            assert codec.digest_update(before, moved) == after
            assert codec.digest_update(digests[-1], moved) == codec.digest_slice(
                _bytes(new), "BF16", offset, box.shape, shape
            )
    assert codec.combine_digests(digests) == codec.digest(_bytes(data), "BF16")


def test_a_slice_outside_its_tensor_is_refused():
    with pytest.raises(codec.PatchError):
        codec.digest_slice(np.zeros(8, np.uint8), "BF16", (3, 0), (2, 2), (4, 2))


def _in_parts(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], kind: str = "full") -> Manifest:
    base = build([("w", "BF16", (4, 6))], kind=kind)
    entry = base.tensors[0]
    parts = tuple(
        entry.model_copy(
            update={
                "changed": math.prod(shape),
                "part": TensorPart(offset=offset, shape=shape, digest="0" * 32),
            }
        )
        for offset, shape in boxes
    )
    stats = base.stats.model_copy(
        update={"changed_elements": sum(p.changed for p in parts), "encoded_bytes": 10 * len(parts)}
    )
    return base.model_copy(update={"tensors": parts, "stats": stats})


def _field(manifest: Manifest) -> str | None:
    try:
        check_manifest(Manifest.model_validate_json(manifest.model_dump_json()))
    except BadManifest as exc:
        return str(exc.extra["field"])
    return None


def test_parts_that_cover_their_tensor_pass():
    assert _field(_in_parts([((0, 0), (4, 3)), ((0, 3), (4, 3))])) is None  # columns
    assert _field(_in_parts([((2, 0), (2, 6)), ((0, 0), (2, 6))])) is None  # rows, any order
    assert _field(_in_parts([((0, 3), (4, 3))], kind="delta")) is None  # a delta: the changed part only


@pytest.mark.parametrize(
    ("boxes", "field"),
    [
        ([((0, 0), (4, 4)), ((0, 3), (4, 3))], "tensors[0].part"),  # overlap
        ([((0, 0), (4, 3))], "tensors[0].part"),  # a keyframe's parts leave elements out
        ([((0, 0), (4, 3)), ((1, 3), (4, 3))], "tensors[1].part"),  # leaves the tensor
        ([((0, 0), (4,))], "tensors[0].part"),  # not the tensor's rank
    ],
)
def test_parts_that_do_not_tile_their_tensor_are_refused(boxes, field):
    assert _field(_in_parts(boxes)) == field


def test_parts_must_agree_on_their_tensor_and_a_whole_entry_is_not_repeated():
    two = _in_parts([((0, 0), (4, 3)), ((0, 3), (4, 3))])
    other = two.tensors[1].model_copy(update={"digest": "1" * 32})
    assert _field(two.model_copy(update={"tensors": (two.tensors[0], other)})) == "tensors[1]"
    whole = two.tensors[0].model_copy(update={"part": None})
    assert _field(two.model_copy(update={"tensors": (whole, whole)})) == "tensors[1].name"


def test_a_whole_entry_is_written_without_a_part_field():
    """Manifests of unsharded publishers read and write as before the field existed."""
    entry = build([("w", "BF16", (4, 6))]).tensors[0]
    assert "part" not in entry.model_dump_json()
    assert TensorEntry.model_validate_json(entry.model_dump_json()) == entry
