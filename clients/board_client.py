"""`BoardClient`: the only HTTP code the publisher and the follower use to talk to a board.

It wraps every route of docs/contract.md section 4 with a synchronous API, retries
connection errors and 5xx answers with exponential backoff, turns error bodies back into
the contract's typed errors (`board.contract.errors`: `except NotHead:`; a 5xx that outlasts
the retries is `BoardUnavailable`), and streams blob downloads to disk with Range resume
and sha256 verification (`BlobIntegrityError` when the bytes do not match). JSON bodies
from `ZSTD_BODIES_FROM` bytes on (a commit of many tensors) are sent as zstd.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx
import zstandard
from pydantic import BaseModel, TypeAdapter, ValidationError

from deltaboard.board.contract.errors import (
    BoardError,
    BoardUnavailable,
    ErrorCode,
    Forbidden,
    InvalidResponse,
    NotFound,
    NotHead,
    Unauthorized,
    UnknownPrepared,
    error_class,
)
from deltaboard.board.contract.schemas import (
    BlobUploadTarget,
    CommitRequest,
    FleetNode,
    Head,
    Heartbeat,
    Lease,
    LeaseRenew,
    LeaseRequest,
    Manifest,
    Plan,
    Prepared,
    RetentionPolicy,
    RetentionReport,
    RunCreate,
    RunInfo,
)
from deltaboard.board.contract.spans import KeyframeManifest, KeyframeRegistered, SpanManifest, SpanRegistered

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

CHUNK = 1024 * 1024
RETRY_STATUSES = frozenset({500, 502, 503, 504})
# A long-poll answers within `wait`; allow that much on top of the normal read timeout.
LONG_POLL_SLACK_S = 10.0
# JSON bodies this large go as zstd (level 1): a commit of 20,000 tensors' manifest is 2.2 MB
# of JSON and ~95 KB of zstd, made in under 1 ms, where it took 17.5 ms of a 1 Gbit/s link
ZSTD_BODIES_FROM = 64 * 1024

Body = bytes | Path | Callable[[], IO[bytes]]


def sha256_of(source: bytes | Path) -> tuple[str, int]:
    """The sha256 hex digest and size of bytes or a file (streamed)."""
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest(), len(source)
    digest = hashlib.sha256()
    size = 0
    with open(source, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


class BlobIntegrityError(Exception):
    """A downloaded blob does not hash to the sha256 it was asked for (the partial file is
    discarded). The board is not known to be at fault: the bytes may have been altered on
    the way; fetch it again once, then give up (`clients.follower.IntegrityError`)."""

    def __init__(self, sha256: str, got: str) -> None:
        super().__init__(f"downloaded blob hashes to {got}, not {sha256}")
        self.sha256 = sha256
        self.got = got


# An answer without the board's JSON body (code `HTTPError`: a HEAD, a proxy's page) is
# classed by the status alone where that says enough.
_BY_STATUS: dict[int, type[BoardError]] = {401: Unauthorized, 403: Forbidden, 404: NotFound}


def error_from(status: int, code: str, message: str, /, **extra: Any) -> BoardError:
    """The typed error for an error answer: the class of its code (`error_class`), or
    `BoardUnavailable` for any 5xx (or its own subclass, e.g. `StoreUnavailable`), which
    callers retry; `http_status` is `status`."""
    cls: type[BoardError]
    if status >= 500:
        known = error_class(code)
        cls = known if issubclass(known, BoardUnavailable) else BoardUnavailable
    elif code == ErrorCode.HTTP_ERROR:
        cls = _BY_STATUS.get(status, BoardError)
    else:
        cls = error_class(code)
    return cls(message, code=code, http_status=status, **extra)


def _error_from(response: httpx.Response) -> BoardError:
    try:
        detail = response.json()["error"]
        extra = {k: v for k, v in detail.items() if k not in ("code", "message")}
        code, message = str(detail["code"]), str(detail["message"])
    except (ValueError, KeyError, TypeError):
        code, message, extra = "HTTPError", response.text[:500] or response.reason_phrase, {}
    return error_from(response.status_code, code, message, **extra)


@contextlib.contextmanager
def _contract(method: str, path: str, status: int) -> Iterator[None]:
    """An answer that does not match its schema is `InvalidResponse`, not a raw pydantic
    error: a stored record the board cannot vouch for, or a board of another version."""
    try:
        yield
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the body"
        raise InvalidResponse(
            f"the board's answer to {method} {path} breaks the contract: {where}: {first['msg']}",
            http_status=status,
        ) from None


class _Partial:
    """The bytes of a download already on disk: their count and running sha256; `progress`
    is told every change of the count."""

    def __init__(self, progress: Callable[[int], None] | None = None) -> None:
        self.progress = progress
        self.size = 0
        self.digest = hashlib.sha256()

    def reset(self) -> None:
        if self.progress is not None and self.size:
            self.progress(-self.size)
        self.size = 0
        self.digest = hashlib.sha256()

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        self.digest.update(chunk)
        if self.progress is not None:
            self.progress(len(chunk))


class BoardClient:
    """A synchronous client of one board. Thread-safe (httpx.Client is); close it when done."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport, limits=limits
        )
        # Presigned URLs carry their own credentials: our bearer token must not travel there.
        self._bare = httpx.Client(timeout=timeout, transport=transport, limits=limits)
        plain = transport is None and self.url.startswith("http://")
        self._plain = (self.url, headers, timeout) if plain else None

    def close(self) -> None:
        self._http.close()
        self._bare.close()

    def __enter__(self) -> BoardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing ----------------------------------------------------------------------

    def _sleep(self, attempt: int) -> None:
        time.sleep(min(self.backoff_s * 2**attempt, 5.0))

    def _retrying(self, send: Callable[[], httpx.Response]) -> httpx.Response:
        """Send, retrying transport errors and 5xx; raise the typed `BoardError` of any other
        failure (`BoardUnavailable` for a 5xx that outlasts the retries)."""
        for attempt in range(self.retries + 1):
            try:
                response = send()
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                self._sleep(attempt)
                continue
            if response.status_code in RETRY_STATUSES and attempt < self.retries:
                self._sleep(attempt)
                continue
            if response.status_code >= 400:
                raise _error_from(response)
            return response
        raise AssertionError("unreachable")

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._retrying(lambda: self._http.request(method, path, **kwargs))

    def _json(self, method: str, path: str, model: type[M], **kwargs: Any) -> M:
        response = self._request(method, path, **kwargs)
        with _contract(method, path, response.status_code):
            return model.model_validate_json(response.content)

    def _list(self, path: str, item: type[T]) -> list[T]:
        response = self._request("GET", path)
        with _contract("GET", path, response.status_code):
            return TypeAdapter(list[item]).validate_json(response.content)  # type: ignore[valid-type]

    @staticmethod
    def _body(model: BaseModel) -> dict[str, Any]:
        return BoardClient._json_body(model.model_dump_json())

    @staticmethod
    def _json_body(text: str) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if len(text) < ZSTD_BODIES_FROM:
            return {"content": text, "headers": headers}
        packed = zstandard.ZstdCompressor(level=1).compress(text.encode())
        return {"content": packed, "headers": {**headers, "Content-Encoding": "zstd"}}

    # ---- health and runs ---------------------------------------------------------------

    def healthz(self) -> bool:
        try:
            return self._http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def create_run(self, name: str, meta: dict[str, Any] | None = None) -> RunInfo:
        return self._json("POST", "/v1/runs", RunInfo, **self._body(RunCreate(name=name, meta=meta or {})))

    def list_runs(self) -> list[RunInfo]:
        return self._list("/v1/runs", RunInfo)

    def get_run(self, run: str) -> RunInfo:
        return self._json("GET", f"/v1/runs/{run}", RunInfo)

    def put_asset(self, run: str, name: str, source: bytes | Path) -> None:
        self._upload(f"/v1/runs/{run}/assets/{name}", source, {})

    def get_asset(self, run: str, name: str) -> bytes:
        return self._request("GET", f"/v1/runs/{run}/assets/{name}").content

    # ---- lease -------------------------------------------------------------------------

    def acquire_lease(self, run: str, holder: str, ttl_s: float = 60.0, *, steal: bool = False) -> Lease:
        body = LeaseRequest(holder=holder, ttl_s=ttl_s, steal=steal)
        return self._json("POST", f"/v1/runs/{run}/lease", Lease, **self._body(body))

    def renew_lease(self, run: str, holder: str, epoch: int, ttl_s: float = 60.0) -> Lease:
        body = LeaseRenew(holder=holder, epoch=epoch, ttl_s=ttl_s)
        return self._json("POST", f"/v1/runs/{run}/lease/renew", Lease, **self._body(body))

    def release_lease(self, run: str, holder: str, epoch: int) -> None:
        self._request("DELETE", f"/v1/runs/{run}/lease", params={"holder": holder, "epoch": epoch})

    # ---- blobs -------------------------------------------------------------------------

    def upload_target(self, run: str, sha256: str, size: int) -> BlobUploadTarget:
        return self._json(
            "POST", f"/v1/runs/{run}/blobs/{sha256}/upload", BlobUploadTarget, params={"size": size}
        )

    def _upload(self, url: str, source: Body, headers: dict[str, str]) -> None:
        """PUT `source` to the board (relative `url`) or a presigned URL, re-reading it on retry."""
        client = self._http if url.startswith("/") else self._bare

        def send() -> httpx.Response:
            if isinstance(source, bytes):
                return client.put(url, content=source, headers=headers)
            with source.open("rb") if isinstance(source, Path) else source() as f:
                size = os.fstat(f.fileno()).st_size - f.tell()
                return client.put(url, content=f, headers={**headers, "Content-Length": str(size)})

        self._retrying(send)

    def upload_blob(self, run: str, source: bytes | Path, sha256: str | None = None) -> str:
        """Upload unless the board already holds it (dedup); returns the sha256."""
        if sha256 is None:
            sha256, size = sha256_of(source)
        else:
            size = len(source) if isinstance(source, bytes) else source.stat().st_size
        target = self.upload_target(run, sha256, size)
        if not target.exists:
            assert target.url is not None
            self._upload(target.url, source, dict(target.headers))
        return sha256

    def blob_size(self, run: str, sha256: str) -> int | None:
        """The stored size, None when the blob is absent."""
        try:
            response = self._request("HEAD", f"/v1/runs/{run}/blobs/{sha256}", follow_redirects=True)
        except NotFound:
            return None
        return int(response.headers["content-length"])

    def plain_http(self) -> tuple[str, dict[str, str], float] | None:
        """(url, headers, timeout) for a reader that speaks HTTP/1.1 itself on hot paths
        (`deltaboard.clients.follower.ranges`), or None: only a client of a plain HTTP
        board through its default transport offers it (TLS and injected transports stay
        with httpx)."""
        return self._plain

    @staticmethod
    def blob_path(run: str, sha256: str) -> str:
        """The path of a blob under the board's URL."""
        return f"/v1/runs/{run}/blobs/{sha256}"

    def get_blob(self, run: str, sha256: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of a blob (the whole blob by default), in memory."""
        headers = {}
        if start is not None or end is not None:
            headers["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
        path = self.blob_path(run, sha256)
        return self._request("GET", path, headers=headers, follow_redirects=True).content

    def download_blob(
        self, run: str, sha256: str, dest: Path, *, progress: Callable[[int], None] | None = None
    ) -> Path:
        """Stream a blob to `dest`, resuming from `dest.part` with Range after interruptions
        (in this call or a previous process), and verify its sha256 before renaming it into
        place (`BlobIntegrityError` when it does not match). `progress(n)` follows the blob's
        bytes on disk: what an earlier attempt left, then each chunk; a failed call takes back
        what it counted, so that a retry (which counts the file again) counts no byte twice
        and a resumed download counts up to the blob's size."""
        part = dest.with_name(dest.name + ".part")
        state = _Partial(progress)
        try:
            if part.exists():
                with open(part, "rb") as f:
                    while chunk := f.read(CHUNK):
                        state.add(chunk)
            for attempt in range(self.retries + 1):
                try:
                    self._download_into(run, sha256, part, state)
                    break
                except httpx.TransportError:
                    if attempt == self.retries:
                        raise
                    self._sleep(attempt)
            if state.digest.hexdigest() != sha256:
                part.unlink(missing_ok=True)
                raise BlobIntegrityError(sha256, state.digest.hexdigest())
        except BaseException:
            state.reset()
            raise
        os.replace(part, dest)
        return dest

    def _download_into(self, run: str, sha256: str, part: Path, state: _Partial) -> None:
        """Append the rest of the blob to `part`; `state` tracks what is on disk, also when a
        connection breaks half-way (the caller then resumes from there)."""
        headers = {"Range": f"bytes={state.size}-"} if state.size else {}
        url = f"/v1/runs/{run}/blobs/{sha256}"
        with self._http.stream("GET", url, headers=headers, follow_redirects=True) as response:
            if response.status_code == 416 and state.size:
                return  # the part file is already complete
            if response.status_code >= 400:
                response.read()
                raise _error_from(response)
            if response.status_code == 200 and state.size:
                state.reset()  # the server ignored the range: start over
            with open(part, "r+b" if state.size else "wb") as f:
                f.seek(state.size)
                f.truncate()
                for chunk in response.iter_bytes():  # httpx re-chunking would copy every byte
                    f.write(chunk)
                    state.add(chunk)

    # ---- versions ----------------------------------------------------------------------

    def prepare(self, run: str, manifest: Manifest, manifest_json: str | None = None) -> Prepared:
        """Have the board check `manifest` and hold it for a commit that names it
        (`commit(..., prepared=...)`): its parse, rules and encoding then happen before the
        commit, while the version's last blob uploads (`board.server.prepared`)."""
        if manifest_json is None:
            manifest_json = manifest.model_dump_json()
        body = self._json_body(f'{{"manifest":{manifest_json}}}')  # a PrepareRequest
        return self._json("POST", f"/v1/runs/{run}/prepare", Prepared, **body)

    def commit(
        self, run: str, manifest: Manifest, manifest_json: str | None = None, prepared: str | None = None
    ) -> Head:
        """Commit; a retried commit that had in fact landed is recognised and succeeds.
        `manifest_json`: the manifest already serialized (`manifest.model_dump_json()`), by
        a caller that needs its size too: a manifest of 20,000 tensors takes ~7 ms to dump.
        `prepared`: the name the board gave `manifest` when it prepared it (`prepare`); the
        commit names it, and sends the manifest itself only if the board no longer holds it
        (`UnknownPrepared`: expired, or prepared by another replica)."""
        try:
            if prepared is not None:
                with contextlib.suppress(UnknownPrepared):
                    named = CommitRequest(prepared=prepared).model_dump_json(exclude_none=True)
                    return self._json("POST", f"/v1/runs/{run}/commit", Head, **self._json_body(named))
            if manifest_json is None:
                manifest_json = manifest.model_dump_json()
            body = self._json_body(f'{{"manifest":{manifest_json}}}')  # a CommitRequest
            return self._json("POST", f"/v1/runs/{run}/commit", Head, **body)
        except NotHead:
            head = self.head(run)
            if head.version is None or head.version < manifest.version:
                raise
            with contextlib.suppress(BoardError):
                if self.manifest(run, manifest.version) == manifest:
                    return Head(run=run, version=manifest.version, kind=manifest.kind, epoch=manifest.epoch)
            raise

    def head(self, run: str, after: int | None = None, wait: float | None = None) -> Head:
        """The head; with `after` and `wait`, a long-poll answering once head > after."""
        params: dict[str, Any] = {}
        if after is not None:
            params["after"] = after
        if wait is not None:
            params["wait"] = wait
        timeout = self._http.timeout.read or 30.0
        return self._json(
            "GET",
            f"/v1/runs/{run}/head",
            Head,
            params=params,
            timeout=timeout + (wait or 0.0) + LONG_POLL_SLACK_S,
        )

    def events(self, run: str) -> Iterator[Head]:
        """Heads from the server-sent event stream, first the current one; runs until closed."""
        with self._http.stream(
            "GET", f"/v1/runs/{run}/events", timeout=httpx.Timeout(30.0, read=None)
        ) as response:
            if response.status_code >= 400:
                response.read()
                raise _error_from(response)
            for line in response.iter_lines():
                if line.startswith("data:"):
                    yield Head.model_validate_json(line[5:].strip())

    def manifest(self, run: str, version: int) -> Manifest:
        return self._json("GET", f"/v1/runs/{run}/manifests/{version}", Manifest)

    def plan(self, run: str, from_version: int | None = None, to_version: int | None = None) -> Plan:
        params = {k: v for k, v in (("from", from_version), ("to", to_version)) if v is not None}
        return self._json("GET", f"/v1/runs/{run}/plan", Plan, params=params)

    def register_span(self, run: str, span: SpanManifest) -> SpanRegistered:
        """Register a span whose blobs are uploaded; idempotent (`created` says whether this
        call stored it)."""
        return self._json("POST", f"/v1/runs/{run}/spans", SpanRegistered, **self._body(span))

    def span(self, run: str, from_version: int, to_version: int) -> SpanManifest:
        return self._json("GET", f"/v1/runs/{run}/spans/{from_version}/{to_version}", SpanManifest)

    def register_keyframe(self, run: str, keyframe: KeyframeManifest) -> KeyframeRegistered:
        """Register a worker keyframe whose blobs are uploaded; idempotent."""
        return self._json("POST", f"/v1/runs/{run}/keyframes", KeyframeRegistered, **self._body(keyframe))

    def keyframe(self, run: str, version: int) -> KeyframeManifest:
        return self._json("GET", f"/v1/runs/{run}/keyframes/{version}", KeyframeManifest)

    # ---- fleet, retention, metrics -----------------------------------------------------

    def heartbeat(self, run: str, beat: Heartbeat) -> None:
        self._request("POST", f"/v1/runs/{run}/fleet", **self._body(beat))

    def fleet(self, run: str) -> list[FleetNode]:
        return self._list(f"/v1/runs/{run}/fleet", FleetNode)

    def retention(self, run: str, policy: RetentionPolicy | None = None) -> RetentionReport:
        return self._json(
            "POST", f"/v1/runs/{run}/retention", RetentionReport, **self._body(policy or RetentionPolicy())
        )

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text
