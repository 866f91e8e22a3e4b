"""Issue 18 item 6: manifest format v2 states a version's entries as columns (each blob's
sha256 once), read and checked without a Python object per entry; v1's list of entries
stays readable and is written back as v1."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deltaboard.board.contract.errors import BadManifest
from deltaboard.board.contract.manifest_rules import check_manifest
from deltaboard.board.contract.schemas import (
    MANIFEST_FORMAT,
    MANIFEST_V1,
    BlobRef,
    CommitRequest,
    Manifest,
    ManifestStats,
    TensorEntry,
    TensorPart,
    TensorTable,
    ViewSpec,
)

SHAS = [f"{i:064x}" for i in range(4)]

entries_st = st.lists(
    st.builds(
        TensorEntry,
        name=st.text(min_size=1, max_size=8),
        dtype=st.sampled_from(["BF16", "F32", "I64"]),
        shape=st.lists(st.integers(0, 9), max_size=3).map(tuple),
        file=st.sampled_from(["model.safetensors", "model-00001-of-00002.safetensors"]),
        blob=st.builds(
            BlobRef, sha256=st.sampled_from(SHAS), offset=st.integers(0, 2**40), length=st.integers(0, 99)
        ),
        digest=st.sampled_from(["0" * 32, "ab" * 16]),
        changed=st.integers(0, 9),
        part=st.none()
        | st.builds(TensorPart, offset=st.just((0,)), shape=st.just((1,)), digest=st.just("c" * 32)),
    ),
    max_size=12,
)


def version(entries: Any, fmt: str = MANIFEST_FORMAT) -> Manifest:
    return Manifest.model_validate(
        {
            "format": fmt,
            "run": "r",
            "version": 1,
            "parent": 0,
            "kind": "delta",
            "view": ViewSpec(),
            "epoch": 1,
            "created_at": 1.0,
            "tensors": entries,
            "state_digest": "0" * 64,
            "stats": ManifestStats(changed_elements=0, total_elements=0, encoded_bytes=0, view_bytes=0),
        }
    )


@settings(max_examples=80, deadline=None)
@given(entries_st)
def test_both_formats_round_trip_the_same_entries(entries):
    v2 = version(entries)
    v1 = version(entries, MANIFEST_V1)
    assert tuple(v2.tensors) == tuple(v1.tensors) == tuple(entries)
    for m in (v1, v2):
        again = Manifest.model_validate_json(m.model_dump_json())
        assert again == m and again.format == m.format and tuple(again.tensors) == tuple(entries)
        assert again.blob_shas() == {e.blob.sha256 for e in entries}
    # each form is read whatever the format says, and written as the format says
    assert version(json.loads(v1.model_dump_json())["tensors"]) == v2
    assert isinstance(json.loads(v1.model_dump_json())["tensors"], list)
    columns = json.loads(v2.model_dump_json())["tensors"]
    assert sorted(columns["blobs"]) == sorted({e.blob.sha256 for e in entries})
    assert ("part" in columns) == any(e.part is not None for e in entries)


def test_a_copy_with_a_tuple_of_entries_serializes_and_checks_as_columns():
    """`model_copy(update={"tensors": (...)})` (followers, tests) sets a plain tuple."""
    entry = TensorEntry(
        name="w",
        dtype="BF16",
        shape=(2,),
        file="model.safetensors",
        blob=BlobRef(sha256=SHAS[0], offset=0, length=1),
        digest="0" * 32,
        changed=1,
    )
    m = version([]).model_copy(update={"tensors": (entry, entry)})
    assert version(json.loads(m.model_dump_json())["tensors"]).tensors == (entry, entry)
    with pytest.raises(BadManifest, match="appears twice") as refused:
        check_manifest(m)
    assert refused.value.extra["field"] == "tensors[1].name"


def columns(**changes: Any) -> dict[str, Any]:
    good = {
        "blobs": SHAS[:2],
        "name": ["a", "b", "c"],
        "dtype": ["BF16"] * 3,
        "shape": [[4], [4], [2, 2]],
        "file": ["model.safetensors"] * 3,
        "blob": [0, 1, 0],
        "offset": [0, 0, 8],
        "length": [8, 8, 8],
        "digest": ["0" * 32] * 3,
        "changed": [1, 2, 3],
    }
    return {**good, **changes}


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"digest": ["0" * 32] * 2}, "tensors.digest has 2 rows, tensors.name 3"),
        ({"blob": [0, 2, 0]}, "must use each of the 2 blobs"),
        ({"blob": [0, 0, 0]}, "must use each of the 2 blobs"),
        ({"blobs": [SHAS[0], SHAS[0]]}, "names a blob twice"),
        ({"blob": [0, -1, 0]}, "greater than or equal to 0"),
        ({"changed": [1, True, 3]}, "valid integer"),
        ({"offset": [0, 0.0, 8]}, "valid integer"),
        ({"blobs": ["F" * 64, SHAS[1]]}, "pattern"),
        ({"name": ["a", "", "c"]}, "at least 1 character"),
        ({"part": [None]}, "tensors.part has 1 rows"),
        ({"extra": [1, 2, 3]}, "Extra inputs"),
    ],
)
def test_malformed_columns_are_refused(changes, problem):
    with pytest.raises(ValidationError, match=problem):
        version(columns(**changes))
    # ... as the board reads a commit: JSON, then the request model
    body = json.dumps(
        {"manifest": json.loads(version(columns()).model_dump_json()) | {"tensors": columns(**changes)}}
    )
    with pytest.raises(ValidationError):
        CommitRequest.model_validate(json.loads(body))


def test_the_rules_name_the_entry_of_a_column():
    m = version(columns(dtype=["BF16", "F99", "BF16"]))
    with pytest.raises(BadManifest) as refused:
        check_manifest(m)
    assert refused.value.extra["field"] == "tensors[1].dtype"
    m = version(columns(changed=[1, 5, 3]))
    with pytest.raises(BadManifest) as refused:
        check_manifest(m)
    assert refused.value.extra["field"] == "tensors[1].changed"


def test_v2_states_each_blob_once():
    entries = [
        TensorEntry(
            name=f"experts.{i}.weight",
            dtype="BF16",
            shape=(64,),
            file="model.safetensors",
            blob=BlobRef(sha256=SHAS[i % 2], offset=i * 16, length=16),
            digest="0" * 32,
            changed=1,
        )
        for i in range(2000)
    ]
    v1, v2 = version(entries, MANIFEST_V1), version(entries)
    stats = ManifestStats(
        changed_elements=2000, total_elements=2000 * 64, encoded_bytes=2000 * 16, view_bytes=2000 * 128
    )
    read = Manifest.model_validate_json(v2.model_copy(update={"stats": stats}).model_dump_json())
    check_manifest(read)
    assert isinstance(read.tensors, TensorTable) and read == v2.model_copy(update={"stats": stats})
    assert len(v2.model_dump_json()) < 0.6 * len(v1.model_dump_json())
    assert json.loads(v2.model_dump_json())["tensors"]["blobs"] == SHAS[:2]
