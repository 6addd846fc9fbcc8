"""An S3-compatible object store as a model source (`s3://BUCKET/PREFIX`), through the MinIO
Python SDK (a maintained S3 client whose dependencies sit well beside the Kubernetes client's).

Credentials come from the environment the fetch Job sets from the spec's Secret
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, optionally `AWS_SESSION_TOKEN`); the SDK's
environment provider reads them, so they never pass through this code. Checksums: an object's
`sha256` user metadata when it has one, else a single-part ETag (the MD5 of the content); a
multipart ETag is no content digest, so such objects are checked by size only (the result
says so). Ranged GETs carry `If-Match` with the listed ETag, so a resumed file never mixes two
versions of an object.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from davit_operator.fetch.result import FetchFailed
from davit_operator.fetch.store import Checksum, RemoteFile

_MD5 = re.compile(r"^[0-9a-f]{32}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
UNAUTHORIZED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        # versitygw answers an unknown access key with this code and HTTP 404.
        "XAdminUserNotFound",
    }
)
MISSING_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "NotFound", "ResourceNotFound"})
DEFAULT_ENDPOINT = "https://s3.amazonaws.com"


def _convert(exc: Exception, what: str) -> FetchFailed:
    from minio.error import InvalidResponseError, S3Error, ServerError

    if isinstance(exc, S3Error):
        status = exc.response.status if exc.response is not None else 0
        text = f"{what}: {exc.code} ({exc.message})"
        if exc.code in UNAUTHORIZED_CODES or status in (401, 403):
            return FetchFailed(
                "Unauthorized",
                f"{text}; the access key in the credentials Secret is missing, wrong, or has "
                "no access to this bucket",
            )
        if exc.code in MISSING_CODES or status == 404:
            return FetchFailed("RevisionNotFound", text)
        if exc.code == "PreconditionFailed" or status == 412:
            return FetchFailed("Transient", f"{text}: the object changed during the fetch")
        return FetchFailed("Transient", text)
    if isinstance(exc, ServerError | InvalidResponseError | OSError):
        return FetchFailed("Transient", f"{what}: {type(exc).__name__}: {exc}")
    raise exc


def _client(endpoint: str | None) -> Any:
    from minio import Minio
    from minio.credentials import EnvAWSProvider

    url = urlsplit(endpoint or DEFAULT_ENDPOINT)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise FetchFailed("InvalidSource", f"{endpoint}: expected an http(s):// endpoint URL")
    return Minio(url.netloc, secure=url.scheme == "https", credentials=EnvAWSProvider())


@dataclass
class S3Source:
    endpoint: str | None
    bucket: str
    prefix: str
    _etags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._client = _client(self.endpoint)

    def close(self) -> None:
        return None

    @property
    def _base(self) -> str:
        return self.prefix.strip("/") + "/"

    def files(self) -> list[RemoteFile]:
        """Every object under the prefix, as paths relative to it."""
        found: list[RemoteFile] = []
        try:
            for obj in self._client.list_objects(self.bucket, prefix=self._base, recursive=True):
                key = str(obj.object_name)
                if obj.is_dir or key.endswith("/"):
                    continue
                path = key[len(self._base) :]
                self._etags[path] = str(obj.etag or "").strip('"')
                found.append(RemoteFile(path, int(obj.size or 0), None))
        except Exception as exc:  # the SDK's errors are converted; anything else propagates
            raise _convert(exc, f"s3://{self.bucket}/{self._base}") from exc
        return found

    def describe(self, file: RemoteFile) -> RemoteFile:
        """`file` with the checksum its object's metadata or ETag gives."""
        key = self._base + file.path
        try:
            stat = self._client.stat_object(self.bucket, key)
        except Exception as exc:
            raise _convert(exc, f"s3://{self.bucket}/{key}") from exc
        etag = str(stat.etag or "").strip('"')
        self._etags[file.path] = etag
        metadata = {str(k).lower(): str(v) for k, v in (stat.metadata or {}).items()}
        sha256 = metadata.get("x-amz-meta-sha256", "").lower()
        checksum = None
        if _SHA256.match(sha256):
            checksum = Checksum("sha256", sha256)
        elif _MD5.match(etag):
            checksum = Checksum("md5", etag)
        return RemoteFile(file.path, int(stat.size or 0), checksum, version=etag or None)

    def version(self) -> str:
        """A digest of every listed key and ETag: what this fetch copied."""
        lines = "\n".join(f"{k} {v}" for k, v in sorted(self._etags.items()))
        return hashlib.sha256(lines.encode()).hexdigest()[:40]

    def open(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        key = self._base + file.path
        headers = {}
        etag = self._etags.get(file.path)
        if etag:
            headers["If-Match"] = f'"{etag}"'
        try:
            response = self._client.get_object(
                self.bucket, key, offset=offset, request_headers=headers
            )
        except Exception as exc:
            raise _convert(exc, f"s3://{self.bucket}/{key}") from exc
        start = offset if offset and response.status == 206 else 0

        def chunks() -> Iterator[bytes]:
            try:
                yield from response.stream(1 << 20)
            except Exception as exc:
                raise _convert(exc, f"s3://{self.bucket}/{key}") from exc
            finally:
                response.close()
                response.release_conn()

        return start, chunks()
