"""Issue 11, what an outside fuzz campaign got through the board's edge (items 1, 4, 7, 8, 9,
10), through the real app in this process with a manual clock: every bad input is a JSON
4xx that stores nothing, and nothing accepted can make a later answer fail."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard
from pydantic import ValidationError
from starlette.testclient import TestClient

from deltaboard.board.contract.errors import InvalidRequest
from deltaboard.board.contract.schemas import ASSET_NAME_RE, RUN_NAME_RE, SHA256_RE, Manifest, RunCreate
from deltaboard.board.server.api.app import create_app
from deltaboard.board.server.api.longpoll import poll_of
from deltaboard.board.server.api.state import check_asset_name, check_sha
from deltaboard.board.server.api.versions import accepts_zstd
from deltaboard.board.server.clock import ManualClock
from deltaboard.board.server.records import manifest_json
from deltaboard.board.server.settings import Settings
from tests.support.manifests import manifest

TOKEN = "admin-token-1"
PAYLOAD = b"w" * 64
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def http(tmp_path: Path, clock: ManualClock) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path / "board", tokens=f"admin:{TOKEN}", fsync=False)
    with TestClient(create_app(settings, clock=clock)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        assert client.post("/v1/runs", json={"name": "r"}).status_code == 201
        assert client.put(f"/v1/runs/r/blobs/{sha(PAYLOAD)}", content=PAYLOAD).status_code == 201
        yield client


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def lease(http: TestClient, ttl_s: float = 60) -> int:
    answer = http.post("/v1/runs/r/lease", json={"holder": "trainer", "ttl_s": ttl_s})
    assert answer.status_code == 201, answer.text
    epoch: int = answer.json()["epoch"]
    return epoch


def version(http: TestClient, number: int, epoch: int) -> Manifest:
    return manifest("r", number, epoch, {"w": PAYLOAD})


def commit(http: TestClient, body: str | Manifest) -> tuple[int, dict[str, object]]:
    text = body if isinstance(body, str) else json.dumps({"manifest": body.model_dump(mode="json")})
    answer = http.post("/v1/runs/r/commit", content=text, headers=JSON)
    return answer.status_code, answer.json()


def code(body: dict[str, object]) -> object:
    error = body["error"]
    assert isinstance(error, dict)
    return error["code"]


def head(http: TestClient) -> int | None:
    number: int | None = http.get("/v1/runs/r/head").json()["version"]
    return number


# ---- item 1: non-finite numbers ----------------------------------------------------------


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_a_non_finite_created_at_is_refused_and_stores_nothing(http, tmp_path, literal):
    m = version(http, 0, lease(http))
    text = json.dumps({"manifest": m.model_dump(mode="json")})
    bad = text.replace(json.dumps(m.created_at), literal)
    assert bad != text
    status, body = commit(http, bad)
    assert (status, code(body)) == (422, "ValidationError"), body
    assert any("created_at" in d["loc"] for d in body["error"]["details"])  # type: ignore[index]
    assert head(http) is None
    assert not list((tmp_path / "board" / "store" / "runs" / "r").glob("manifests/*"))
    assert commit(http, m)[0] == 201  # the same manifest with a real stamp commits


@pytest.mark.parametrize("literal", ["NaN", "1e999"])
@pytest.mark.parametrize(
    ("method", "path", "template"),
    [
        ("POST", "/v1/runs", '{"name": "s", "meta": {"loss": [1, {"x": %s}]}}'),
        ("POST", "/v1/runs/r/fleet", '{"node_id": "n", "version": null, "meta": {"lr": %s}}'),
        ("POST", "/v1/runs/r/lease", '{"holder": "h", "ttl_s": %s}'),
        ("POST", "/v1/runs/r/retention", '{"grace_s": %s}'),
    ],
)
def test_non_finite_numbers_anywhere_in_a_body_are_refused(http, method, path, template, literal):
    answer = http.request(
        method, path, content=template % literal, headers={"Content-Type": "application/json"}
    )
    assert (answer.status_code, code(answer.json())) == (422, "ValidationError"), answer.text
    assert http.get("/v1/runs/r/fleet").json() == []
    assert [r["name"] for r in http.get("/v1/runs").json()] == ["r"]


def test_a_non_finite_number_in_commit_meta_is_refused(http):
    m = version(http, 0, lease(http)).model_copy(update={"meta": {"loss": 1.5}})
    text = json.dumps({"manifest": m.model_dump(mode="json")})
    # Only the meta's number: a bare "1.5" can also sit inside the manifest's timestamp.
    bad = text.replace('"loss": 1.5', '"loss": Infinity')
    assert bad.count("Infinity") == 1
    status, body = commit(http, bad)
    assert (status, code(body)) == (422, "ValidationError")


# ---- item 4 and 7: lone surrogates, invalid UTF-8 -----------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/runs/r/fleet", b'{"node_id": "n", "version": null, "meta": {"k": "\\ud800"}}'),
        ("/v1/runs/r/fleet", b'{"node_id": "n", "version": null, "meta": {"\\udfff": 1}}'),
        ("/v1/runs/r/fleet", b'{"node_id": "n\\ud800", "version": null}'),
        ("/v1/runs/r/fleet", b'{"node_id": "n", "version": null, "engine": "\xed\xa0\x80"}'),
        ("/v1/runs/r/fleet", b'{"node_id": "n", "version": null, "engine": "\xff"}'),
        ("/v1/runs", b'{"name": "s", "meta": {"note": "a\\ud800b"}}'),
        ("/v1/runs/r/lease", b'{"holder": "\\ud800"}'),
    ],
)
def test_unencodable_strings_are_refused_and_later_answers_still_work(http, path, body):
    answer = http.post(path, content=body, headers=JSON)
    assert (answer.status_code, code(answer.json())) == (400, "MalformedJSON"), answer.text
    assert http.get("/v1/runs/r/fleet").status_code == 200
    assert http.get("/v1/runs").status_code == 200
    assert http.get("/v1/runs/r").status_code == 200


def test_a_lone_surrogate_in_commit_meta_is_refused(http):
    m = version(http, 0, lease(http)).model_copy(update={"meta": {"note": "SURROGATE"}})
    text = json.dumps({"manifest": m.model_dump(mode="json")}).replace("SURROGATE", "\\ud800")
    status, body = commit(http, text)
    assert (status, code(body)) == (400, "MalformedJSON")
    assert head(http) is None


def test_a_paired_surrogate_escape_is_an_ordinary_character(http):
    body = b'{"node_id": "n", "version": null, "meta": {"smile": "\\ud83d\\ude00"}}'
    assert (
        http.post("/v1/runs/r/fleet", content=body, headers={"Content-Type": "application/json"}).status_code
        == 204
    )
    assert http.get("/v1/runs/r/fleet").json()[0]["meta"] == {"smile": "\U0001f600"}


# ---- item 7: booleans are not numbers; names end where they end ---------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/runs/r/fleet", {"node_id": "n", "version": False}),
        ("/v1/runs/r/lease", {"holder": "h", "ttl_s": True}),
        ("/v1/runs/r/lease/renew", {"holder": "h", "epoch": True}),
        ("/v1/runs/r/retention", {"keep_last": True}),
    ],
)
def test_a_boolean_is_not_a_number(http, path, body):
    answer = http.post(path, json=body)
    assert (answer.status_code, code(answer.json())) == (422, "ValidationError"), answer.text


def test_a_boolean_version_in_a_manifest_is_refused(http):
    m = version(http, 0, lease(http))
    data = m.model_dump(mode="json")
    data["version"] = False
    status, body = commit(http, json.dumps({"manifest": data}))
    assert (status, code(body)) == (422, "ValidationError")
    assert head(http) is None


def test_a_trailing_newline_does_not_end_a_name(http):
    assert http.put("/v1/runs/r/assets/config.json", content=b"{}").status_code == 201
    answer = http.put("/v1/runs/r/assets/config.json%0A", content=b"overwritten")
    assert (answer.status_code, code(answer.json())) == (400, "BadRequest")
    assert http.get("/v1/runs/r/assets/config.json").content == b"{}"
    for method, path in [
        ("POST", f"/v1/runs/r/blobs/{sha(PAYLOAD)}%0A/upload?size=1"),
        ("PUT", f"/v1/runs/r/blobs/{sha(PAYLOAD)}%0A"),
        ("GET", f"/v1/runs/r/blobs/{sha(PAYLOAD)}%0A"),
        ("GET", "/v1/runs/r%0A/head"),
        ("GET", "/v1/runs/r/head%0A"),
        ("GET", "/v1/runs/r/assets/config.json%00"),
    ]:
        answer = http.request(method, path, content=b"x" if method == "PUT" else None)
        assert (answer.status_code, code(answer.json())) == (400, "BadRequest"), (method, path, answer.text)


def test_names_are_matched_whole():
    """Behind the path check, the name checks use `fullmatch`: `$` alone would let a
    trailing newline through."""
    for check, name in [(check_sha, sha(PAYLOAD) + "\n"), (check_asset_name, "config.json\n")]:
        with pytest.raises(InvalidRequest):
            check(name)
    with pytest.raises(ValidationError):
        RunCreate(name="r\n")
    # The long-poll's fast path (outside the app) leaves such a poll to the app's checks.
    poll = {"type": "http", "method": "GET", "path": "/v1/runs/r/head", "query_string": b"after=1"}
    assert poll_of(poll) == ("r", 1, 0.0)
    assert poll_of({**poll, "path": "/v1/runs/r/head\n"}) is None
    assert poll_of({**poll, "query_string": b"after=1%0A"}) is None


# ---- item 8: manifests are checked whole --------------------------------------------------


def with_entry(m: Manifest, **changes: object) -> Manifest:
    return m.model_copy(update={"tensors": (m.tensors[0].model_copy(update=changes),)})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dtype": "F99"}, "tensors[0].dtype"),
        ({"dtype": "../../etc"}, "tensors[0].dtype"),
        ({"shape": (-64,)}, "tensors[0].shape"),
        ({"shape": (2**31, 2**31)}, "tensors[0].shape"),
        ({"file": "../model.safetensors"}, "tensors[0].file"),
        ({"file": "sub/model.safetensors"}, "tensors[0].file"),
        ({"file": "model-00003-of-00002.safetensors"}, "tensors[0].file"),
        ({"changed": 65}, "tensors[0].changed"),
    ],
)
def test_a_manifest_breaking_a_rule_is_refused_naming_the_field(http, tmp_path, changes, field):
    status, body = commit(http, with_entry(version(http, 0, lease(http)), **changes))
    assert (status, code(body)) == (422, "BadManifest"), body
    assert body["error"]["field"] == field and field in body["error"]["message"]  # type: ignore[index]
    assert head(http) is None
    assert not list((tmp_path / "board" / "store" / "runs" / "r").glob("manifests/*"))


def test_a_manifest_with_malformed_digests_is_refused(http):
    m = version(http, 0, lease(http))
    for bad in (with_entry(m, digest="../x"), m.model_copy(update={"state_digest": "0" * 32})):
        data = bad.model_dump(mode="json")
        status, body = commit(http, json.dumps({"manifest": data}))
        assert (status, code(body)) == (422, "ValidationError")


def test_a_manifest_whose_stats_do_not_add_up_is_refused(http):
    m = version(http, 0, lease(http))
    for stats, field in [
        ({"encoded_bytes": 1}, "stats.encoded_bytes"),
        ({"changed_elements": 0}, "stats.changed_elements"),
        ({"view_bytes": 10**6}, "stats.view_bytes"),  # a keyframe's totals are its entries'
    ]:
        bad = m.model_copy(update={"stats": m.stats.model_copy(update=stats)})
        status, body = commit(http, bad)
        assert (status, code(body), body["error"]["field"]) == (422, "BadManifest", field)  # type: ignore[index]


# ---- item 9: no commit without a live lease -----------------------------------------------


def test_a_commit_after_the_lease_was_released_is_refused(http):
    epoch = lease(http)
    assert commit(http, version(http, 0, epoch))[0] == 201
    assert http.delete("/v1/runs/r/lease", params={"holder": "trainer", "epoch": epoch}).status_code == 204
    status, body = commit(http, version(http, 1, epoch))
    assert (status, code(body)) == (409, "NoLease")
    assert head(http) == 0


def test_a_commit_after_the_lease_expired_is_refused_until_it_is_renewed(http, clock):
    epoch = lease(http, ttl_s=30)
    clock.advance(29)
    assert commit(http, version(http, 0, epoch))[0] == 201
    clock.advance(1)  # expires_at == now: expired
    status, body = commit(http, version(http, 1, epoch))
    assert (status, code(body)) == (409, "NoLease")
    renewed = http.post("/v1/runs/r/lease/renew", json={"holder": "trainer", "epoch": epoch, "ttl_s": 30})
    assert renewed.status_code == 200
    assert commit(http, version(http, 1, epoch))[0] == 201


# ---- item 10: 405 says what is allowed ----------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/v1/runs/r/fleet", "GET, POST"),
        ("DELETE", "/v1/runs/r", "GET"),
        ("PATCH", "/v1/runs/r/lease", "DELETE, POST"),
    ],
)
def test_405_answers_name_every_allowed_method(http, method, path, allow):
    answer = http.request(method, path)
    assert (answer.status_code, code(answer.json())) == (405, "MethodNotAllowed")
    assert answer.headers["allow"] == allow


# ---- issue 16 item 20: manifests compact on the wire, and counted -------------------------


def test_manifests_travel_gzipped_and_plans_count_them(http, tmp_path):
    epoch = lease(http)
    names = {f"layer.{i}.weight": PAYLOAD for i in range(40)}  # a manifest of some kilobytes
    m = manifest("r", 0, epoch, names)
    assert commit(http, m)[0] == 201
    path = tmp_path / "board" / "store" / "runs" / "r" / "manifests" / f"{0:012d}.json"
    stored = manifest_json(path.read_bytes())  # the JSON, stored as one zstd frame
    raw = http.get("/v1/runs/r/manifests/0", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in raw.headers and raw.content == stored
    packed = http.get("/v1/runs/r/manifests/0", headers={"Accept-Encoding": "gzip"})
    assert packed.headers["content-encoding"] == "gzip"
    assert int(packed.headers["content-length"]) < len(stored) / 3
    assert Manifest.model_validate_json(packed.content) == m  # decoded by the client
    plan = http.get("/v1/runs/r/plan").json()
    assert plan["manifest_bytes"] == plan["steps"][0]["manifest_bytes"] == len(stored)
    assert plan["total_bytes"] == len(PAYLOAD)


def test_manifests_travel_as_stored_to_clients_that_accept_zstd(http, tmp_path):
    """The stored zstd frame itself, no compression per request; the JSON once decoded.
    A client that does not accept zstd (or refuses it, q=0) gets gzip or plain JSON."""
    epoch = lease(http)
    names = {f"layer.{i}.weight": PAYLOAD for i in range(40)}
    m = manifest("r", 0, epoch, names)
    assert commit(http, m)[0] == 201
    path = tmp_path / "board" / "store" / "runs" / "r" / "manifests" / f"{0:012d}.json"
    stored = path.read_bytes()
    for accept in ("zstd", "gzip, deflate, zstd", "br;q=0.5, ZSTD;q=0.8"):
        raw = http.get("/v1/runs/r/manifests/0", headers={"Accept-Encoding": accept})
        assert raw.headers["content-encoding"] == "zstd" and "Accept-Encoding" in raw.headers["vary"]
        # the test client does not decode zstd (`BoardClient`'s httpx does: every follower test)
        assert raw.content == stored  # the record itself, no compression per request
        assert Manifest.model_validate_json(zstandard.decompress(raw.content)) == m
    for accept, encoding in (("zstd;q=0, gzip", "gzip"), ("zstd;q=0", None), ("identity", None)):
        answer = http.get("/v1/runs/r/manifests/0", headers={"Accept-Encoding": accept})
        assert answer.headers.get("content-encoding") == encoding, accept
        assert answer.content == manifest_json(stored)


def test_a_plain_json_record_is_served_packed_to_zstd_clients(http, tmp_path):
    """An older board's plain JSON record: zstd clients get a frame of it, others the JSON."""
    epoch = lease(http)
    m = manifest("r", 0, epoch, {f"layer.{i}.weight": PAYLOAD for i in range(40)})
    assert commit(http, m)[0] == 201
    path = tmp_path / "board" / "store" / "runs" / "r" / "manifests" / f"{0:012d}.json"
    path.write_bytes(manifest_json(path.read_bytes()))  # before anything read it (no cache yet)
    raw = http.get("/v1/runs/r/manifests/0", headers={"Accept-Encoding": "zstd"})
    assert raw.headers["content-encoding"] == "zstd"
    assert zstandard.decompress(raw.content) == path.read_bytes()
    plain = http.get("/v1/runs/r/manifests/0", headers={"Accept-Encoding": "identity"})
    assert plain.content == path.read_bytes()


def test_accept_encoding_lists_zstd_only_with_a_weight_above_zero():
    assert accepts_zstd("zstd") and accepts_zstd("gzip, zstd;q=0.1") and accepts_zstd(" Zstd ; q=1")
    assert not accepts_zstd("") and not accepts_zstd("gzip, br") and not accepts_zstd("zstd;q=0")
    assert not accepts_zstd("zstd;q=0.000") and not accepts_zstd("zstd;q=bad") and not accepts_zstd("xzstd")


def test_blobs_are_never_gzipped(http):
    blob = b"\0" * 100_000  # as compressible as bytes get
    assert http.put(f"/v1/runs/r/blobs/{sha(blob)}", content=blob).status_code == 201
    for headers in ({}, {"Range": "bytes=10-50009"}):
        answer = http.get(f"/v1/runs/r/blobs/{sha(blob)}", headers={"Accept-Encoding": "gzip", **headers})
        assert "content-encoding" not in answer.headers
        assert len(answer.content) == (100_000 if not headers else 50_000)


# ---- item 10: the schema says what the board answers --------------------------------------


def test_the_openapi_schema_declares_errors_security_and_patterns(http):
    spec = http.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"] | {"description": ""} == {
        "type": "http",
        "scheme": "bearer",
        "description": "",
    }
    error_body = {"$ref": "#/components/schemas/ErrorBody"}
    patterns = {"run": RUN_NAME_RE.pattern, "sha256": SHA256_RE.pattern, "name": ASSET_NAME_RE.pattern}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            if path == "/healthz":
                assert "security" not in operation
                continue
            assert operation["security"] == [{"HTTPBearer": []}], (method, path)
            wanted = {"401", "403", "503"} | ({"400", "404", "422"} if "{run}" in path else set())
            for status in wanted:
                content = operation["responses"][status]["content"]["application/json"]
                assert content["schema"] == error_body, (method, path, status)
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path" and parameter["name"] in patterns:
                    assert parameter["schema"]["pattern"] == patterns[parameter["name"]]
    assert {"409", "413", "422"} <= set(spec["paths"]["/v1/runs/{run}/commit"]["post"]["responses"])
    assert "416" in spec["paths"]["/v1/runs/{run}/blobs/{sha256}"]["get"]["responses"]
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # 422 is ErrorBody everywhere
