"""Issue 11 items 1 and 8, against real board processes: a record in the store that the
board cannot read (a manifest an older, laxer board accepted) never stops the board from
starting or answering; it is reported and skipped. Clients get one typed error for it, and
a follower one clear line. Also item 7: a request uvicorn's parser refuses still gets the
board's JSON; and issue 16 item 20: the client receives manifests gzipped."""

from __future__ import annotations

import json
import re
import socket
import threading
from pathlib import Path

import httpx
import pytest

from deltaboard.board.contract.errors import BadManifest, InvalidResponse, UnknownVersion
from deltaboard.board.contract.schemas import MANIFEST_FORMAT, MANIFEST_V1
from deltaboard.board.server.records import manifest_json
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower import Follower, FollowerError
from deltaboard.clients.follower.errors import UnusableManifest
from tests.clients.support import assert_view, publish_states
from tests.support.manifests import manifest, publish
from tests.support.servers import BoardServer

SIZES = {"embed.weight": (64, 32), "layers.0.weight": (32, 32), "layers.0.bias": (32,)}


def stored_manifest(board: BoardServer, run: str, version: int) -> Path:
    return board.data_dir / "store" / "runs" / run / "manifests" / f"{version:012d}.json"


def rewrite(path: Path, **fields: object) -> None:
    """Change fields of a stored manifest's first tensor (`tensor_*`) or of the manifest."""
    data = json.loads(manifest_json(path.read_bytes()))
    for name, value in fields.items():
        if name.startswith("tensor_"):
            data["tensors"][name.removeprefix("tensor_")][0] = value  # format v2: by column
        else:
            data[name] = value
    path.write_text(json.dumps(data))


def as_v1(path: Path) -> None:
    """Rewrite a stored manifest as boards stored them before format v2: a list of entries,
    each with its blob's sha256 (written out here, not by the schema under test)."""
    data = json.loads(manifest_json(path.read_bytes()))
    t = data["tensors"]
    columns = (
        t[k] for k in ("name", "dtype", "shape", "file", "blob", "offset", "length", "digest", "changed")
    )
    data["format"] = "deltaboard/manifest/v1"
    data["tensors"] = [
        {
            "name": name,
            "dtype": dtype,
            "shape": shape,
            "file": file,
            "blob": {"sha256": t["blobs"][blob], "offset": offset, "length": length},
            "digest": digest,
            "changed": changed,
        }
        for name, dtype, shape, file, blob, offset, length, digest, changed in zip(*columns, strict=True)
    ]
    path.write_text(json.dumps(data))


def unreadable_count(board: BoardServer) -> float:
    found = re.search(r"^deltaboard_unreadable_records_total (\S+)$", board.client().metrics(), re.MULTILINE)
    assert found is not None
    return float(found.group(1))


def test_an_unreadable_manifest_is_skipped_and_the_board_still_starts(board):
    c = board.client(board.publish_token)
    for run in ("bad", "good"):
        c.create_run(run)
        epoch = c.acquire_lease(run, "t").epoch
        publish(c, run, 0, epoch, {"w": b"zero" * 10})
        publish(c, run, 1, epoch, {"w": b"one" * 10})
    # What the board stored for a NaN stamp before it refused them.
    rewrite(stored_manifest(board, "bad", 1), created_at=None)
    (board.data_dir / "store" / "runs" / "broken" / "run.json").parent.mkdir()
    (board.data_dir / "store" / "runs" / "broken" / "run.json").write_text('{"name": "broken"}')
    board.restart()

    reader = board.client(board.read_token)
    assert unreadable_count(board) == 2
    assert "skipping runs/bad/manifests/000000000001.json" in board.log_text()
    assert [r.name for r in reader.list_runs()] == ["bad", "good"]
    assert reader.head("bad").version == 1
    assert reader.manifest("bad", 0).version == 0
    with pytest.raises(InvalidResponse, match="created_at"):
        reader.manifest("bad", 1)
    with pytest.raises(UnknownVersion):  # no plan names the version the board cannot read
        reader.plan("bad")
    assert [s.version for s in reader.plan("good").steps] == [0, 1]


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"tensor_dtype": "F99"}, "tensors[0].dtype: 'F99' is not one of"),
        ({"tensor_shape": [-40]}, "tensors[0].shape: [-40] has a negative dimension"),
        ({"tensor_file": "../../model.safetensors"}, "tensors[0].file"),
    ],
)
def test_a_follower_refuses_a_bad_stored_manifest_in_one_line(board, tmp_path, fields, problem):
    c = board.client(board.publish_token)
    c.create_run("r")
    publish(c, "r", 0, c.acquire_lease("r", "t").epoch, {"w": b"zero" * 10})
    rewrite(stored_manifest(board, "r", 0), **fields)
    board.restart()
    with (
        Follower(board.client(board.read_token), "r", tmp_path / "model", node_id="n") as follower,
        pytest.raises(FollowerError) as refused,
    ):
        follower.sync()
    message = str(refused.value)
    assert message.startswith("the manifest of r@0 is unusable: ") and problem in message
    assert "\n" not in message
    assert not list((tmp_path / "model").glob("*.safetensors"))
    # `follow` gives up on it at once, where it retries what a retry can fix
    with (
        Follower(board.client(board.read_token), "r", tmp_path / "model", node_id="n") as follower,
        pytest.raises(UnusableManifest),
    ):
        follower.follow(threading.Event())


def test_a_request_the_http_parser_refuses_gets_json(board):
    with socket.create_connection(("127.0.0.1", board.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/runs HTTP/1.1\r\nHost: board\r\nContent-Length: 12345678901234567890123456\r\n\r\n"
        )
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "BadRequest" and error["message"].startswith("the HTTP request is malformed")
    assert board.client().healthz()


class Recording(httpx.HTTPTransport):
    """The real transport, noting each answer's Content-Encoding."""

    def __init__(self) -> None:
        super().__init__()
        self.encodings: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.encodings.append(response.headers.get("content-encoding"))
        return response


def test_the_client_fetches_manifests_as_stored_and_plans_gzipped(board):
    """`BoardClient` accepts zstd: a manifest comes as the board stores it (one zstd frame,
    no compression per request), JSON answers such as plans gzipped."""
    c = board.client(board.publish_token)
    c.create_run("r")
    payloads = {f"model.layers.{i}.mlp.weight": bytes([i]) * 10 for i in range(50)}
    committed = manifest("r", 0, c.acquire_lease("r", "t").epoch, payloads)
    for data in payloads.values():
        c.upload_blob("r", data)
    c.commit("r", committed)
    transport = Recording()
    with BoardClient(board.url, board.read_token, transport=transport) as reader:
        assert reader.manifest("r", 0) == committed
        plan = reader.plan("r")
    assert transport.encodings == ["zstd", "gzip"]
    assert plan.manifest_bytes == len(manifest_json(stored_manifest(board, "r", 0).read_bytes()))


def test_manifests_stored_as_v1_stay_readable_by_the_board_and_followers(board, tmp_path):
    """Format v2 (entries as columns) leaves what older boards stored readable: the board
    rebuilds its index over v1 manifests and plans through them, a follower applies a
    chain of v1 and v2 manifests, and the publisher commits on top of them."""
    writer = board.client(board.publish_token)
    views = publish_states(writer, "r", SIZES, 3)
    for version in (0, 1):
        as_v1(stored_manifest(board, "r", version))
    board.restart()
    reader = board.client(board.read_token)
    assert [reader.manifest("r", v).format for v in range(3)] == [MANIFEST_V1, MANIFEST_V1, MANIFEST_FORMAT]
    assert reader.manifest("r", 1).tensors[0].blob.sha256 in reader.manifest("r", 1).blob_shas()
    assert [s.version for s in reader.plan("r").steps] == [0, 1, 2]
    assert unreadable_count(board) == 0
    with Follower(reader, "r", tmp_path / "model", node_id="n") as follower:
        assert follower.sync(1) == 1
        assert_view(tmp_path / "model", views[1])
        assert follower.sync() == 2
        assert_view(tmp_path / "model", views[2])


def test_a_v1_commit_is_stored_and_served_as_v1(board):
    """An older publisher's commit (format v1) is checked like a v2 one and kept in its
    own format, byte for byte what it sent."""
    c = board.client(board.publish_token)
    c.create_run("r")
    payloads = {f"w{i}": bytes([i]) * 10 for i in range(3)}
    for data in payloads.values():
        c.upload_blob("r", data)
    old = manifest("r", 0, c.acquire_lease("r", "t").epoch, payloads).model_copy(
        update={"format": MANIFEST_V1}
    )
    c.commit("r", old)
    as_json = manifest_json(stored_manifest(board, "r", 0).read_bytes())
    stored = json.loads(as_json)
    assert stored["format"] == MANIFEST_V1 and isinstance(stored["tensors"], list)
    assert as_json == old.model_dump_json().encode()
    assert board.client(board.read_token).manifest("r", 0) == old
    bad = old.model_copy(update={"version": 1, "parent": 0, "kind": "delta", "tensors": old.tensors[:1]})
    with pytest.raises(BadManifest, match=r"stats\.changed_elements"):
        c.commit("r", bad)
