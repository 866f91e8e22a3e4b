"""S3 (any endpoint, through boto3) as the object store: for several board replicas and
for followers that download straight from the bucket via presigned URLs.

Conditional writes map to S3's `If-None-Match: *` (create-if-absent) and `If-Match: <etag>`
(compare-and-set); both are enforced by AWS S3 and by SeaweedFS (checked by
tests/board/test_storage.py against a real SeaweedFS). Presigned uploads sign the
`x-amz-checksum-sha256` header, so the store itself rejects bytes that do not hash to the
blob's name.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from board.settings import Settings
from board.storage import ObjectInfo, ObjectNotFound, PreconditionFailed

PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


class S3Store:
    def __init__(self, client: Any, bucket: str, prefix: str = "") -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Store:
        assert settings.store is not None
        bucket, _, prefix = settings.store.removeprefix("s3://").partition("/")
        client = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint,
            region_name=settings.s3_region,
            aws_access_key_id=settings.s3_access_key,
            aws_secret_access_key=settings.s3_secret_key,
            config=Config(max_pool_connections=64, retries={"mode": "standard", "max_attempts": 4}),
        )
        return cls(client, bucket, prefix)

    def _key(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str) -> tuple[bytes, str]:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if _code(e) in NOT_FOUND_CODES:
                raise ObjectNotFound(key) from None
            raise
        return response["Body"].read(), str(response["ETag"])

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        extra: dict[str, str] = {}
        if if_none_match:
            extra["IfNoneMatch"] = "*"
        elif if_match is not None:
            extra["IfMatch"] = if_match
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
        except ClientError as e:
            if _code(e) in PRECONDITION_CODES or (if_match is not None and _code(e) in NOT_FOUND_CODES):
                raise PreconditionFailed(key) from None
            raise
        return str(response["ETag"])

    def put_file(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, self._key(key))
        path.unlink(missing_ok=True)

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
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
            for item in page.get("Contents", []):
                yield ObjectInfo(
                    key=item["Key"][len(self.prefix) :],
                    size=int(item["Size"]),
                    modified=item["LastModified"].timestamp(),
                )

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def local_path(self, key: str) -> Path | None:
        return None

    def presign_download(self, key: str, expires_s: int) -> str | None:
        url: str = self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires_s
        )
        return url

    def presign_upload(self, key: str, sha256: str, expires_s: int) -> tuple[str, dict[str, str]] | None:
        checksum = base64.b64encode(bytes.fromhex(sha256)).decode()
        url: str = self.client.generate_presigned_url(
            "put_object",
            Params={"Bucket": self.bucket, "Key": self._key(key), "ChecksumSHA256": checksum},
            ExpiresIn=expires_s,
        )
        return url, {"x-amz-checksum-sha256": checksum}
