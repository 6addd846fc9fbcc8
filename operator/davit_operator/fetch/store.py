"""The model cache on its volume: layout, partial files, resumption and verification.

Layout under the cache root (the volume's mount point):

- `hf/` is a Hugging Face hub cache (what `HF_HUB_CACHE` points at in the replicas):
  `hf/models--ORG--NAME/blobs/<etag>` holds each file once, `snapshots/<commit>/<path>` links
  to it, `refs/<revision>` names the commit. Partial files are `blobs/<etag>.incomplete`, as
  the hub library keeps them, so an interrupted fetch continues where it stopped.
- `s3/<bucket>/<prefix>/<revision>/` is a plain model directory; its partial files live in
  `s3/<bucket>/<prefix>/<revision>.partial/` until verified.
- `.davit/entries/<key>.json` marks a complete entry (written last, atomically).

A file moves to its final place only after its size and checksum matched the source's, so a
final file is always a verified one and a partial one is never read by an engine.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from davit_operator.fetch.result import FetchFailed, FetchResult, FileRecord

CHUNK_BYTES = 1 << 20
ENTRIES_DIR = ".davit/entries"


@dataclass(frozen=True)
class Checksum:
    """What the source says a file's digest is: `sha256`, `git-sha1` (the hub's id of a file
    kept in git, sha1 over `blob SIZE\\0` + content) or `md5` (a single-part S3 ETag)."""

    algorithm: str
    hexdigest: str

    def hasher(self, size: int) -> Any:
        if self.algorithm == "git-sha1":
            h = hashlib.sha1(usedforsecurity=False)
            h.update(f"blob {size}\0".encode())
            return h
        if self.algorithm == "md5":
            return hashlib.md5(usedforsecurity=False)
        return hashlib.new(self.algorithm)

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hexdigest}"


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the model's root
    size: int
    checksum: Checksum | None
    # What identifies this content at the source when the checksum may not (an S3 ETag).
    version: str | None = None

    @property
    def identity(self) -> str | None:
        """A short name for this content: its version, else its checksum (None: neither)."""
        text = self.version or (str(self.checksum) if self.checksum is not None else None)
        return hashlib.sha256(text.encode()).hexdigest()[:16] if text else None


class Opener(Protocol):
    def __call__(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        """Open `file` from byte `offset`: returns the offset the source honoured (0 when it
        ignored the range) and the content from there."""
        ...


class Entry(Protocol):
    """Where one (source, revision) lives in the cache."""

    @property
    def key(self) -> str: ...
    @property
    def directory(self) -> Path:
        """The directory an engine loads."""
        ...

    def final_path(self, file: RemoteFile) -> Path: ...
    def partial_path(self, file: RemoteFile) -> Path: ...
    def publish(self, file: RemoteFile) -> None:
        """Make a verified final file visible in `directory` (a link for the hub layout)."""
        ...


def _safe_relative(path: str) -> str:
    parts = Path(path).parts
    if path.startswith("/") or ".." in parts or not parts:
        raise FetchFailed("InvalidSource", f"refusing the file path {path!r} from the source")
    return path


@dataclass(frozen=True)
class HubEntry:
    """A snapshot in the hub cache layout."""

    root: Path
    repo_id: str
    revision: str
    commit: str

    @property
    def key(self) -> str:
        return entry_key("hf", self.repo_id, self.revision)

    @property
    def repo_dir(self) -> Path:
        return self.root / "hf" / ("models--" + self.repo_id.replace("/", "--"))

    @property
    def directory(self) -> Path:
        return self.repo_dir / "snapshots" / self.commit

    def _blob_name(self, file: RemoteFile) -> str:
        if file.checksum is None:
            raise FetchFailed("InvalidSource", f"{file.path}: the hub gave no checksum")
        return file.checksum.hexdigest

    def final_path(self, file: RemoteFile) -> Path:
        return self.repo_dir / "blobs" / self._blob_name(file)

    def partial_path(self, file: RemoteFile) -> Path:
        return self.repo_dir / "blobs" / f"{self._blob_name(file)}.incomplete"

    def publish(self, file: RemoteFile) -> None:
        link = self.directory / _safe_relative(file.path)
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(self.final_path(file), link.parent)
        if link.is_symlink() and os.readlink(link) == target:
            return
        tmp = link.with_name(link.name + ".link")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)

    def write_ref(self) -> None:
        if self.revision == self.commit:
            return
        ref = self.repo_dir / "refs" / self.revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(ref, self.commit)


@dataclass(frozen=True)
class DirectoryEntry:
    """A plain model directory (S3 sources)."""

    root: Path
    scheme: str
    location: str  # BUCKET/PREFIX
    revision: str

    @property
    def key(self) -> str:
        return entry_key(self.scheme, self.location, self.revision)

    @property
    def directory(self) -> Path:
        return self.root / self.scheme / self.location / self.revision

    def final_path(self, file: RemoteFile) -> Path:
        return self.directory / _safe_relative(file.path)

    @property
    def partial_directory(self) -> Path:
        return self.directory.with_name(self.directory.name + ".partial")

    def partial_path(self, file: RemoteFile) -> Path:
        # Named after the object's version too: an object replaced between two attempts
        # starts a new partial file instead of continuing the old content with the new.
        path = _safe_relative(file.path)
        if file.identity is not None:
            path = f"{path}.{file.identity}"
        return self.partial_directory / path

    def publish(self, file: RemoteFile) -> None:
        return None


def entry_key(scheme: str, location: str, revision: str) -> str:
    """The cache entry's name: the same for every service and replica of one (source,
    revision); the operator computes the same key to name the fetch Job."""
    text = f"{scheme}://{location}@{revision}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _disk_errors(what: str) -> Callable[[OSError], FetchFailed]:
    def convert(exc: OSError) -> FetchFailed:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return FetchFailed("DiskFull", f"the model cache volume is full while writing {what}")
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return FetchFailed("InvalidSource", f"cannot write {what} into the model cache: {exc}")
        return FetchFailed("Transient", f"writing {what}: {exc}")

    return convert


class Counter(Protocol):
    def add(self, n: int) -> None: ...


def fetch_file(entry: Entry, file: RemoteFile, opener: Opener, counter: Counter) -> int:
    """Bring `file` into `entry`, continuing a partial copy; returns the bytes transferred.

    Raises FetchFailed: ChecksumMismatch (the partial copy is removed, so a retry starts
    clean), DiskFull, or Transient for errors worth retrying.
    """
    final = entry.final_path(file)
    convert = _disk_errors(file.path)
    if final.is_file() and final.stat().st_size == file.size:
        counter.add(file.size)
        entry.publish(file)
        return 0
    partial = entry.partial_path(file)
    try:
        partial.parent.mkdir(parents=True, exist_ok=True)
        offset = partial.stat().st_size if partial.exists() else 0
        if offset > file.size:
            partial.unlink()
            offset = 0
        hasher = file.checksum.hasher(file.size) if file.checksum is not None else None
        if offset and hasher is not None:
            with partial.open("rb") as existing:
                while chunk := existing.read(CHUNK_BYTES):
                    hasher.update(chunk)
        counter.add(offset)
        transferred = 0
        if offset < file.size:
            start, chunks = opener(file, offset)
            if start != offset:  # the source ignored the range: start over
                counter.add(-offset)
                offset = 0
                hasher = file.checksum.hasher(file.size) if file.checksum is not None else None
            with partial.open("r+b" if offset else "wb") as out:
                if offset:
                    out.seek(offset)
                    out.truncate()
                for chunk in chunks:
                    out.write(chunk)
                    if hasher is not None:
                        hasher.update(chunk)
                    transferred += len(chunk)
                    counter.add(len(chunk))
                out.flush()
                os.fsync(out.fileno())
        size = partial.stat().st_size
        if size != file.size:
            if size > file.size:
                partial.unlink()
                raise FetchFailed(
                    "ChecksumMismatch",
                    f"{file.path}: the source sent {size} bytes, its listing says {file.size}",
                )
            raise FetchFailed(
                "Transient", f"{file.path}: the transfer stopped at {size} of {file.size} bytes"
            )
        if hasher is not None and file.checksum is not None:
            digest = hasher.hexdigest()
            if digest != file.checksum.hexdigest:
                partial.unlink()
                raise FetchFailed(
                    "ChecksumMismatch",
                    f"{file.path}: content {file.checksum.algorithm} {digest} does not match "
                    f"the source's {file.checksum.hexdigest} ({file.size} bytes); the copy was "
                    "discarded",
                )
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, final)
        entry.publish(file)
    except OSError as exc:
        raise convert(exc) from exc
    return transferred


def record_of(file: RemoteFile) -> FileRecord:
    return FileRecord(
        path=file.path, size=file.size, checksum=str(file.checksum) if file.checksum else "size"
    )


def mark_complete(root: Path, key: str, result: FetchResult) -> None:
    """Write the entry's completion marker (the result document), last and atomically."""
    marker = root / ENTRIES_DIR / f"{key}.json"
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(marker, result.to_json())
    except OSError as exc:
        raise _disk_errors("the completion marker")(exc) from exc


def read_marker(root: Path, key: str) -> dict[str, Any] | None:
    marker = root / ENTRIES_DIR / f"{key}.json"
    try:
        doc = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
