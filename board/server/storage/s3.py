"""S3 (any endpoint, through boto3) as the object store: for several board replicas and
for followers that download straight from the bucket via presigned URLs.

Create-if-absent is `If-None-Match: *`. Compare-and-set does *not* use `If-Match`: on
SeaweedFS 4.48 it is not atomic (two of six racing writers with the same ETag both
succeeded in 4 of 30 trials, while `If-None-Match` never let two through in 60 eight-way
races). A record is therefore a series of generations `{key}@{n:012d}`, each created with
`If-None-Match`; the highest is current and its number is the version tag, so
compare-and-set from tag n is "create generation n+1", which exactly one writer wins on
any S3 that makes `If-None-Match` atomic (AWS, SeaweedFS, MinIO). Writing generation n
deletes n-2, so a record stays two or three objects. A writer that stalls for two or more
generations could then recreate a deleted one and be told it succeeded, but what it wrote
is never visible (readers take the highest generation), and every decision the board takes
re-reads the current records, so such a writer is still fenced off at its next step.
Presigned uploads sign `x-amz-checksum-sha256`, so the store
itself rejects bytes that do not hash to the blob's name.

A store that cannot be reached (refused, timed out, closed mid-answer, or answering 5xx)
is `StoreUnavailable` (503 with `Retry-After` at the API edge), never a raw botocore error;
every call has bounded timeouts and tries (`Settings.s3_*`), so a frozen store costs a
request a few seconds.
"""

from __future__ import annotations

import base64
import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import boto3
from boto3.exceptions import S3UploadFailedError
from botocore.config import Config
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as StoreConnectionError
from s3transfer.exceptions import RetriesExceededError

from deltaboard.board.contract.errors import StoreUnavailable
from deltaboard.board.server.settings import Settings
from deltaboard.board.server.storage import ObjectInfo, ObjectNotFound, PreconditionFailed, write_in_order

PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
GENERATION = "@"
READ_ATTEMPTS = 4
KEEP_GENERATIONS = 2
NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# What a store that is down, frozen or overloaded raises (after botocore's own retries).
OUTAGES = (
    StoreConnectionError,
    HTTPClientError,
    IncompleteReadError,
    S3UploadFailedError,
    RetriesExceededError,
)


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Turn the store's outages into `StoreUnavailable` (also usable as a decorator)."""
    try:
        yield
    except OUTAGES as e:
        raise StoreUnavailable(f"the object store does not answer ({type(e).__name__}): retry later") from e
    except ClientError as e:
        if int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)) >= 500:
            raise StoreUnavailable(f"the object store failed ({_code(e)}): retry later") from e
        raise


class S3Store:
    def __init__(self, client: Any, bucket: str, prefix: str = "", presigner: Any = None) -> None:
        self.client = client
        # Presigned URLs are for followers and publishers, who may reach the store by
        # another address than the board does (a public endpoint, another region's).
        self.presigner = presigner or client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        # The newest generation seen per record: listings start after it (S3 StartAfter).
        self._latest: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Store:
        assert settings.store is not None
        bucket, _, prefix = settings.store.removeprefix("s3://").partition("/")

        def client(endpoint: str | None) -> Any:
            return boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name=settings.s3_region,
                aws_access_key_id=settings.s3_access_key,
                aws_secret_access_key=settings.s3_secret_key,
                config=Config(
                    max_pool_connections=64,
                    connect_timeout=settings.s3_connect_timeout_s,
                    read_timeout=settings.s3_read_timeout_s,
                    retries={"mode": "standard", "max_attempts": settings.s3_attempts},
                ),
            )

        public = settings.s3_public_endpoint
        return cls(client(settings.s3_endpoint), bucket, prefix, client(public) if public else None)

    def _key(self, key: str) -> str:
        return self.prefix + key

    @_reachable()
    def get(self, key: str) -> bytes:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if _code(e) in NOT_FOUND_CODES:
                raise ObjectNotFound(key) from None
            raise
        data: bytes = response["Body"].read()
        return data

    @_reachable()
    def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
        except ClientError as e:
            if _code(e) in PRECONDITION_CODES:
                raise PreconditionFailed(key) from None
            raise

    def _generation_key(self, key: str, generation: int) -> str:
        return f"{key}{GENERATION}{generation:012d}"

    @_reachable()
    def _generations(self, key: str, after: int | None) -> list[int]:
        prefix = self._key(key) + GENERATION
        args = {"Bucket": self.bucket, "Prefix": prefix}
        if after is not None:
            args["StartAfter"] = self._key(self._generation_key(key, after))
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(**args):
            for item in page.get("Contents", []):
                suffix = item["Key"][len(prefix) :]
                if suffix.isdigit():
                    found.append(int(suffix))
        return sorted(found)

    def _newest(self, key: str) -> int | None:
        with self._lock:
            hint = self._latest.get(key)
        found = self._generations(key, hint)
        newest = found[-1] if found else hint
        if newest is not None:
            self._remember(key, newest)
        return newest

    def _remember(self, key: str, generation: int | None) -> None:
        with self._lock:
            if generation is None:
                self._latest.pop(key, None)
            else:
                self._latest[key] = max(generation, self._latest.get(key, generation))

    def read_record(self, key: str) -> tuple[bytes, str] | None:
        for _ in range(READ_ATTEMPTS):
            generation = self._newest(key)
            if generation is None:
                return None
            try:
                return self.get(self._generation_key(key, generation)), str(generation)
            except ObjectNotFound:
                self._remember(key, None)  # deleted meanwhile (delete_record): list again
        raise ObjectNotFound(key)

    def write_record(self, key: str, data: bytes, expected: str | None) -> str:
        if expected is None:
            if self._newest(key) is not None:
                raise PreconditionFailed(key)
            generation = 0
        else:
            generation = int(expected) + 1
        self.put(self._generation_key(key, generation), data, if_none_match=True)
        self._remember(key, generation)
        if generation >= KEEP_GENERATIONS:
            # Best effort: a leftover only costs a longer listing for a new process.
            with contextlib.suppress(ClientError, StoreUnavailable):
                self.delete(self._generation_key(key, generation - KEEP_GENERATIONS))
        return str(generation)

    def write_records(self, writes: Sequence[tuple[str, bytes, str | None]]) -> int:
        return write_in_order(self, writes)

    @_reachable()
    def delete_record(self, key: str) -> None:
        for generation in self._generations(key, None):
            self.delete(self._generation_key(key, generation))
        self._remember(key, None)

    @_reachable()
    def put_file(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, self._key(key))
        path.unlink(missing_ok=True)

    @_reachable()
    def stat(self, key: str) -> ObjectInfo | None:
        try:
            response = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if _code(e) in NOT_FOUND_CODES:
                return None
            raise
        return ObjectInfo(
            key=key, size=int(response["ContentLength"]), modified=response["LastModified"].timestamp()
        )

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        with _reachable():
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
                for item in page.get("Contents", []):
                    yield ObjectInfo(
                        key=item["Key"][len(self.prefix) :],
                        size=int(item["Size"]),
                        modified=item["LastModified"].timestamp(),
                    )

    @_reachable()
    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def local_path(self, key: str) -> Path | None:
        return None

    def presign_download(self, key: str, expires_s: int) -> str | None:
        url: str = self.presigner.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires_s
        )
        return url

    def presign_upload(self, key: str, sha256: str, expires_s: int) -> tuple[str, dict[str, str]] | None:
        checksum = base64.b64encode(bytes.fromhex(sha256)).decode()
        url: str = self.presigner.generate_presigned_url(
            "put_object",
            Params={"Bucket": self.bucket, "Key": self._key(key), "ChecksumSHA256": checksum},
            ExpiresIn=expires_s,
        )
        return url, {"x-amz-checksum-sha256": checksum}

    def close(self) -> None:
        pass  # every write was durable when S3 answered it
