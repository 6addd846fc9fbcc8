"""What a fetch reports: progress while it runs, and the result or the failure at the end.

The fetcher writes `FetchResult.to_json()` or `FetchFailure.to_json()` to its termination
message (at most 4096 bytes, so file lists are capped) and serves `Progress` as JSON on
`GET /progress`. The operator parses the same classes back (`parse_outcome`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# Why a fetch failed; every reason but Transient fails the Job at once (exit PERMANENT_EXIT).
FailureReason = Literal[
    "RevisionNotFound",  # the repository, revision, bucket or prefix does not exist
    "Unauthorized",  # 401/403: missing or wrong credentials
    "ChecksumMismatch",  # a file's content does not match the source's checksum
    "DiskFull",  # the cache volume ran out of space
    "NoModelFiles",  # the source has no weights the engines load
    "InvalidSource",  # the source or the arguments cannot be used
    "Transient",  # network or server error: the Job retries and resumes
]
PERMANENT_EXIT = 3
TRANSIENT_EXIT = 1
MESSAGE_LIMIT = 4096
MAX_LISTED_FILES = 24


@dataclass(frozen=True)
class FileRecord:
    """One fetched file: its path in the model, size, and the checksum it was verified with
    (`sha256:...`, `git-sha1:...`, `md5:...`, or `size` when the source gives none)."""

    path: str
    size: int
    checksum: str


@dataclass(frozen=True)
class FetchResult:
    """A complete cache entry: where it is (relative to the cache root), what it holds."""

    source: str
    revision: str
    commit: str  # the hub's commit hash; for S3 a digest of the objects' keys and ETags
    path: str  # entry directory relative to the cache root (a snapshot or a plain directory)
    bytes_total: int
    bytes_fetched: int  # bytes transferred by this run (0 when the entry was already complete)
    files: list[FileRecord] = field(default_factory=list)
    kind: Literal["result"] = "result"

    def to_json(self) -> str:
        doc = asdict(self)
        files = doc.pop("files")
        doc["numFiles"] = len(files)
        doc["files"] = files[:MAX_LISTED_FILES]
        return _compact(doc)


@dataclass(frozen=True)
class FetchFailure:
    reason: FailureReason
    message: str
    kind: Literal["failure"] = "failure"

    @property
    def permanent(self) -> bool:
        return self.reason != "Transient"

    def to_json(self) -> str:
        doc = asdict(self)
        text = _compact(doc)
        if len(text.encode()) > MESSAGE_LIMIT:
            doc["message"] = self.message[: MESSAGE_LIMIT // 2] + "..."
            text = _compact(doc)
        return text


@dataclass(frozen=True)
class Progress:
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    current: str | None = None

    def to_json(self) -> str:
        return _compact(asdict(self))


class FetchFailed(Exception):
    """Raised inside the fetcher; `main` turns it into a FetchFailure."""

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(message)
        self.failure = FetchFailure(reason, message)


def _compact(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def parse_outcome(text: str) -> FetchResult | FetchFailure | None:
    """The result or failure in a termination message; None when it is neither."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    try:
        if doc.get("kind") == "result":
            files = [FileRecord(**f) for f in doc.get("files") or []]
            return FetchResult(
                source=str(doc["source"]),
                revision=str(doc["revision"]),
                commit=str(doc["commit"]),
                path=str(doc["path"]),
                bytes_total=int(doc["bytes_total"]),
                bytes_fetched=int(doc["bytes_fetched"]),
                files=files,
            )
        if doc.get("kind") == "failure":
            return FetchFailure(reason=doc["reason"], message=str(doc["message"]))
    except (KeyError, TypeError, ValueError):
        return None
    return None


def parse_progress(text: str) -> Progress | None:
    try:
        doc = json.loads(text)
        return Progress(
            bytes_done=int(doc["bytes_done"]),
            bytes_total=int(doc["bytes_total"]),
            files_done=int(doc["files_done"]),
            files_total=int(doc["files_total"]),
            current=doc.get("current"),
        )
    except (ValueError, KeyError, TypeError):
        return None
