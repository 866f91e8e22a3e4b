"""The contract's manifest rules (board.contract.manifest_rules): pure, no I/O."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltaboard.board.contract.errors import BadManifest
from deltaboard.board.contract.manifest_rules import check_entries, check_manifest
from deltaboard.board.contract.schemas import BlobRef, Manifest, ManifestStats, TensorEntry, ViewSpec
from deltaboard.board.contract.view_spec import DTYPE_WIDTHS, nbytes, plan_layout

BLOB = BlobRef(sha256=hashlib.sha256(b"blob").hexdigest(), offset=0, length=10)


def build(
    tensors: list[tuple[str, str, tuple[int, ...]]], kind: str = "full", shard_max: int = 4096
) -> Manifest:
    """A manifest as a publisher writes it: the view rules' files, stats that add up."""
    view = ViewSpec(shard_max_bytes=shard_max)
    layout = plan_layout(tensors, view)
    entries = tuple(
        TensorEntry(
            name=name,
            dtype=dtype,
            shape=shape,
            file=layout.placement[name],
            blob=BLOB,
            digest="0" * 32,
            changed=math.prod(shape),
        )
        for name, dtype, shape in tensors
    )
    elements = sum(math.prod(shape) for _, _, shape in tensors)
    return Manifest(
        run="r",
        version=0 if kind == "full" else 1,
        parent=None if kind == "full" else 0,
        kind="full" if kind == "full" else "delta",
        view=view,
        epoch=1,
        created_at=0.0,
        tensors=entries,
        state_digest="0" * 64,
        stats=ManifestStats(
            changed_elements=elements,
            total_elements=elements,
            encoded_bytes=BLOB.length * len(entries),
            view_bytes=sum(nbytes(d, s) for _, d, s in tensors),
        ),
    )


tensor_lists = st.lists(
    st.tuples(
        st.sampled_from(list(DTYPE_WIDTHS)),
        st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    ),
    min_size=1,
    max_size=12,
).map(lambda ts: [(f"t{i}", d, s) for i, (d, s) in enumerate(ts)])


@given(tensors=tensor_lists, shard_max=st.integers(1, 8192))
def test_what_a_publisher_writes_passes(tensors, shard_max):
    check_manifest(build(tensors, shard_max=shard_max))


def refusal(m: Manifest, check=check_manifest) -> str:
    with pytest.raises(BadManifest) as refused:
        check(m)
    field: str = refused.value.extra["field"]
    assert refused.value.message.startswith(f"{field}: ")
    return field


def entry(m: Manifest, **changes: object) -> Manifest:
    first = m.tensors[0].model_copy(update=changes)
    return m.model_copy(update={"tensors": (first, *m.tensors[1:])})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dtype": "F128"}, "tensors[0].dtype"),
        ({"dtype": "bf16"}, "tensors[0].dtype"),
        ({"shape": (4, -1)}, "tensors[0].shape"),
        ({"shape": (2**20, 2**20, 2**20)}, "tensors[0].shape"),
        ({"changed": 9}, "tensors[0].changed"),
        ({"file": "model.safetensors/../../x"}, "tensors[0].file"),
        ({"file": "..\\\\model.safetensors"}, "tensors[0].file"),
        ({"file": "model-00000-of-00001.safetensors"}, "tensors[0].file"),
        ({"file": "model.safetensors\n"}, "tensors[0].file"),
    ],
)
def test_bad_entries_are_refused_by_board_and_follower_alike(changes, field):
    m = entry(build([("a", "F32", (2, 4)), ("b", "I64", (3,))]), **changes)
    assert refusal(m, check_entries) == field
    assert refusal(m) == field


def test_the_follower_subset_ignores_stats():
    m = build([("a", "F32", (2, 4))])
    check_entries(
        m.model_copy(
            update={
                "stats": ManifestStats(changed_elements=0, total_elements=0, encoded_bytes=0, view_bytes=0)
            }
        )
    )


def test_stats_must_add_up():
    m = build([("a", "F32", (2, 4)), ("b", "BF16", (3,))])
    for stats, field in [
        ({"changed_elements": 10}, "stats.changed_elements"),
        ({"encoded_bytes": 21}, "stats.encoded_bytes"),
        ({"total_elements": 12}, "stats.total_elements"),
        ({"view_bytes": 39}, "stats.view_bytes"),
    ]:
        assert refusal(m.model_copy(update={"stats": m.stats.model_copy(update=stats)})) == field


def test_a_delta_lists_some_tensors_of_a_larger_view():
    full = build([("a", "F32", (2, 4)), ("b", "BF16", (3,))])
    delta = build([("a", "F32", (2, 4))], kind="delta")
    view_wide = delta.stats.model_copy(update={"total_elements": 11, "view_bytes": full.stats.view_bytes})
    check_manifest(delta.model_copy(update={"stats": view_wide}))
    too_small = delta.stats.model_copy(update={"total_elements": 7})
    assert refusal(delta.model_copy(update={"stats": too_small})) == "stats.total_elements"


def test_a_keyframe_places_its_tensors_where_the_view_rules_do():
    m = build([("a", "F32", (512,)), ("b", "F32", (512,))], shard_max=2048)
    assert [t.file for t in m.tensors] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert refusal(entry(m, file="model-00002-of-00002.safetensors")) == "tensors[0].file"
