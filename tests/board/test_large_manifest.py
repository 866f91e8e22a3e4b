"""Issue 18 item 6, the board's share: a manifest of a model of 20,000 tensors is checked
over whole columns (`manifest_rules`, `rules.check_blob_ranges`), with no Python step per
entry. A mistake deep in a column is still refused as a JSON 4xx naming the first entry
that breaks a rule, with that entry's first broken rule, and a refused commit leaves
nothing behind."""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaboard.board.contract.errors import BadManifest
from deltaboard.board.contract.manifest_rules import MAX_TENSOR_BYTES, SHARD_FILE_RE, check_entries
from deltaboard.board.contract.schemas import MANIFEST_FORMAT, Manifest, ViewSpec
from deltaboard.board.contract.view_spec import DTYPE_WIDTHS
from tests.support.servers import BoardServer, board_server

ENTRIES = 20_000
DEEP = 17_321  # the row a mistake is made in
ELEMENTS = 64  # each tensor's, BF16
RANGE = 8  # each entry's bytes of the blob
BLOB = bytes(range(256)) * (ENTRIES * RANGE // 256)
SHA = hashlib.sha256(BLOB).hexdigest()


def columns_manifest(version: int, epoch: int, rows: int = ENTRIES) -> dict[str, Any]:
    """A v2 delta of `rows` BF16 tensors, each a range of `BLOB`, as a publisher sends it."""
    return {
        "format": MANIFEST_FORMAT,
        "run": "r",
        "version": version,
        "parent": version - 1,
        "kind": "delta",
        "view": ViewSpec().model_dump(),
        "epoch": epoch,
        "created_at": 1.0,
        "meta": {},
        "tensors": {
            "blobs": [SHA],
            "name": [f"layers.{i}.experts.weight" for i in range(rows)],
            "dtype": ["BF16"] * rows,
            "shape": [[ELEMENTS]] * rows,
            "file": ["model.safetensors"] * rows,
            "blob": [0] * rows,
            "offset": [RANGE * i for i in range(rows)],
            "length": [RANGE] * rows,
            "digest": ["ab" * 16] * rows,
            "changed": [1] * rows,
        },
        "state_digest": "0" * 64,
        "stats": {
            "changed_elements": rows,
            "total_elements": rows * ELEMENTS,
            "encoded_bytes": rows * RANGE,
            "view_bytes": rows * ELEMENTS * 2,
        },
    }


def with_rows(body: dict[str, Any], **rows: dict[int, Any]) -> dict[str, Any]:
    """`body` with column values replaced: `with_rows(m, dtype={DEEP: "F128"})`."""
    changed = copy.deepcopy(body)
    for column, values in rows.items():
        for i, value in values.items():
            changed["tensors"][column][i] = value
    return changed


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BoardServer]:
    server = board_server(tmp_path_factory.mktemp("large-manifest")).start()
    c = server.client()
    c.create_run("r")
    epoch = c.acquire_lease("r", "t", ttl_s=3600).epoch
    c.upload_blob("r", BLOB)
    keyframe = columns_manifest(0, epoch, rows=1)
    keyframe.update(parent=None, kind="full")
    keyframe["stats"].update(encoded_bytes=RANGE, changed_elements=1)
    c.commit("r", Manifest.model_validate(keyframe))
    try:
        yield server
    finally:
        server.stop()


def store_files(board: BoardServer) -> set[str]:
    root = board.data_dir / "store" / "runs"
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def commit(board: BoardServer, manifest: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{board.url}/v1/runs/r/commit",
        json={"manifest": manifest},
        headers={"Authorization": f"Bearer {board.publish_token}"},
        timeout=60,
    )


def test_a_mistake_deep_in_a_column_is_refused_naming_its_entry_and_leaves_nothing(board):
    epoch = board.client().head("r").epoch
    assert epoch is not None
    good = columns_manifest(1, epoch)
    before = store_files(board)
    cases: list[tuple[dict[str, Any], str, str]] = [
        (with_rows(good, dtype={DEEP: "F128"}), "BadManifest", f"tensors[{DEEP}].dtype"),
        (with_rows(good, shape={DEEP: [4, -16]}), "BadManifest", f"tensors[{DEEP}].shape"),
        (with_rows(good, shape={DEEP: [2**20] * 3}), "BadManifest", f"tensors[{DEEP}].shape"),
        (with_rows(good, changed={DEEP: ELEMENTS + 1}), "BadManifest", f"tensors[{DEEP}].changed"),
        (with_rows(good, file={DEEP: "../model.safetensors"}), "BadManifest", f"tensors[{DEEP}].file"),
        # two rows break rules: the first is named, with its first broken rule
        (
            with_rows(good, file={DEEP: "x"}, changed={DEEP - 9: 10**30}, dtype={DEEP - 9: "F128"}),
            "BadManifest",
            f"tensors[{DEEP - 9}].dtype",
        ),
        # a range beyond the stored blob (the stats still add up: only the offset moves)
        (with_rows(good, offset={DEEP: len(BLOB) - 1}), "BadManifest", ""),
        # the form, in pydantic's core: the row is in the location
        (with_rows(good, digest={DEEP: "xyz"}), "ValidationError", str(DEEP)),
        (with_rows(good, offset={DEEP: True}), "ValidationError", str(DEEP)),
    ]
    for body, code, where in cases:
        answer = commit(board, body)
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["code"] == code
        if code == "ValidationError":
            assert any(str(detail["loc"][-1]) == where for detail in error["details"]), error
        elif where:
            assert error["field"] == where
        else:
            assert f"layers.{DEEP}.experts.weight" in error["message"]
    assert store_files(board) == before
    assert board.client().head("r").version == 0
    assert commit(board, good).status_code == 201
    stored = board.client().manifest("r", 1)
    assert stored == Manifest.model_validate(good) and len(stored.tensors) == ENTRIES


def first_refusal(body: dict[str, Any]) -> str | None:
    """What a loop over the entries refuses first (the field), as the contract tells the
    rules: dtype, shape, size, changed elements, file."""
    t = body["tensors"]
    for i, (dtype, shape, changed, file) in enumerate(
        zip(t["dtype"], t["shape"], t["changed"], t["file"], strict=True)
    ):
        if dtype not in DTYPE_WIDTHS:
            return f"tensors[{i}].dtype"
        if any(d < 0 for d in shape) or DTYPE_WIDTHS[dtype] * math.prod(shape) > MAX_TENSOR_BYTES:
            return f"tensors[{i}].shape"
        if changed > math.prod(shape):
            return f"tensors[{i}].changed"
        if not shard_file(file):
            return f"tensors[{i}].file"
    return None


def shard_file(name: str) -> bool:
    """`model.safetensors`, or `model-0000k-of-0000n.safetensors` with 1 <= k <= n."""
    found = SHARD_FILE_RE.fullmatch(name)
    return found is not None and (found.group(1) is None or 1 <= int(found.group(1)) <= int(found.group(2)))


mistakes = st.lists(
    st.tuples(
        st.integers(0, 199),
        st.sampled_from(
            [
                ("dtype", "F128"),
                ("shape", [3, -1]),
                ("shape", [-2, -2]),
                ("shape", [2**30, 2**30]),
                ("changed", ELEMENTS + 1),
                ("changed", 10**40),
                ("file", "model.safetensors\n"),
                ("file", "model-00002-of-00001.safetensors"),
            ]
        ),
    ),
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(mistakes)
def test_the_column_checks_refuse_what_a_loop_over_entries_refuses_first(mistakes):
    body = columns_manifest(1, 1, rows=200)
    for row, (column, value) in mistakes:
        body = with_rows(body, **{column: {row: value}})
    m = Manifest.model_validate(body)
    expected = first_refusal(body)
    if expected is None:
        check_entries(m)
        return
    with pytest.raises(BadManifest) as refused:
        check_entries(m)
    assert refused.value.extra["field"] == expected
