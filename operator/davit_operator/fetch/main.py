"""`davit fetch`: copy one model source at one revision into the model cache.

    davit fetch --source hf://ORG/NAME --revision REV [--endpoint URL] --cache DIR
    davit fetch --source s3://BUCKET/PREFIX --revision LABEL [--endpoint URL] --cache DIR

Exit status: 0 when the entry is complete (fetched now or before), PERMANENT_EXIT when
retrying cannot help (missing revision, 401/403, checksum mismatch, full disk), TRANSIENT_EXIT
for errors the Job's retry resumes from. The outcome goes to `--result-file` (the pod's
termination message); `GET /progress` on `--host`:`--port` serves the bytes done and total
while it runs. Credentials come only from the environment (`HF_TOKEN`; boto3's `AWS_*`) and
are never printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from davit_operator.fetch.result import (
    PERMANENT_EXIT,
    TRANSIENT_EXIT,
    FetchFailed,
    FetchFailure,
    FetchResult,
    Progress,
)
from davit_operator.fetch.select import has_weights, needed
from davit_operator.fetch.store import (
    DirectoryEntry,
    Entry,
    HubEntry,
    RemoteFile,
    fetch_file,
    mark_complete,
    record_of,
)

LOG_EVERY_SECONDS = 10.0


class Tracker:
    """Bytes done across the files of this fetch (thread-safe; read by the progress server)."""

    def __init__(self, max_bytes_per_second: int | None = None) -> None:
        self.max_bytes_per_second = max_bytes_per_second
        self._lock = threading.Lock()
        self.progress = Progress(0, 0, 0, 0)
        self._last_log = 0.0

    def start(self, total: int, files: int) -> None:
        with self._lock:
            self.progress = Progress(0, total, 0, files)

    def add(self, n: int) -> None:
        with self._lock:
            p = self.progress
            self.progress = Progress(
                p.bytes_done + n, p.bytes_total, p.files_done, p.files_total, p.current
            )
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_SECONDS:
            self._last_log = now
            p = self.progress
            print(f"fetch: {p.bytes_done} of {p.bytes_total} bytes ({p.current})", flush=True)

    def file(self, current: str | None, done: bool = False) -> None:
        with self._lock:
            p = self.progress
            self.progress = Progress(
                p.bytes_done, p.bytes_total, p.files_done + int(done), p.files_total, current
            )


def _serve_progress(tracker: Tracker, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/progress":
                self.send_error(404)
                return
            body = tracker.progress.to_json().encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None  # one line per operator poll says nothing

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="progress", daemon=True).start()
    return server


def _throttled(open_file: Any, max_bytes_per_second: int | None) -> Any:
    """`open_file` whose content arrives at most at `max_bytes_per_second` (None: as fast as
    the source sends it), so a fetch leaves bandwidth to the serving replicas."""
    if not max_bytes_per_second:
        return open_file
    rate = float(max_bytes_per_second)

    def opened(file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        start, chunks = open_file(file, offset)

        def paced() -> Iterator[bytes]:
            began, sent = time.monotonic(), 0
            for chunk in chunks:
                sent += len(chunk)
                ahead = sent / rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
                yield chunk

        return start, paced()

    return opened


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="davit fetch",
        description="Copy the files an engine needs from a model source into the model cache.",
    )
    parser.add_argument("--source", required=True, help="hf://ORG/NAME or s3://BUCKET/PREFIX")
    parser.add_argument("--revision", required=True, help="hub revision, or the S3 label")
    parser.add_argument("--endpoint", default=None, help="hub or S3 endpoint URL")
    parser.add_argument("--cache", required=True, type=Path, help="the cache volume's root")
    parser.add_argument("--host", default="0.0.0.0", help="progress server address")
    parser.add_argument("--port", type=int, default=8090, help="progress server port (0: off)")
    parser.add_argument(
        "--max-bytes-per-second",
        type=int,
        default=None,
        help="bandwidth limit of the transfer (default: none)",
    )
    parser.add_argument(
        "--result-file",
        type=Path,
        default=Path("/dev/termination-log"),
        help="where the outcome document goes (the pod's termination message)",
    )
    return parser


def _fetch_all(
    entry: Entry, files: list[RemoteFile], open_file: Any, tracker: Tracker
) -> tuple[int, int]:
    total = sum(f.size for f in files)
    tracker.start(total, len(files))
    open_file = _throttled(open_file, tracker.max_bytes_per_second)
    fetched = 0
    for file in files:
        tracker.file(file.path)
        fetched += fetch_file(entry, file, open_file, tracker)
        tracker.file(None, done=True)
    return total, fetched


def fetch_hub(args: argparse.Namespace, tracker: Tracker) -> FetchResult:
    from davit_operator.fetch.hub import DEFAULT_ENDPOINT, HubSource

    repo_id = args.source.removeprefix("hf://").strip("/")
    source = HubSource(args.endpoint or DEFAULT_ENDPOINT, repo_id, os.environ.get("HF_TOKEN"))
    try:
        commit = source.resolve(args.revision)
        listing = {f.path: f for f in source.files(commit)}
        paths = needed(listing)
        if not has_weights(paths):
            raise FetchFailed(
                "NoModelFiles",
                f"{repo_id} at {commit} has no .safetensors weights at its root "
                f"(files: {', '.join(sorted(listing)[:20])})",
            )
        files = [listing[p] for p in paths]
        entry = HubEntry(args.cache, repo_id, args.revision, commit)
        total, fetched = _fetch_all(
            entry, files, lambda f, offset: source.open(commit, f, offset), tracker
        )
        entry.write_ref()
    finally:
        source.close()
    return _complete(args, entry, commit, total, fetched, files)


def fetch_s3(args: argparse.Namespace, tracker: Tracker) -> FetchResult:
    from davit_operator.fetch.s3 import S3Source

    location = args.source.removeprefix("s3://").strip("/")
    bucket, _, prefix = location.partition("/")
    if not bucket or not prefix:
        raise FetchFailed("InvalidSource", f"{args.source}: expected s3://BUCKET/PREFIX")
    source = S3Source(args.endpoint, bucket, prefix)
    try:
        listing = {f.path: f for f in source.files()}
        paths = needed(listing)
        if not has_weights(paths):
            raise FetchFailed(
                "NoModelFiles" if listing else "RevisionNotFound",
                f"{args.source} has no .safetensors weights"
                + (f" (objects: {', '.join(sorted(listing)[:20])})" if listing else " (empty)"),
            )
        files = [source.describe(listing[p]) for p in paths]
        entry = DirectoryEntry(args.cache, "s3", location, args.revision)
        total, fetched = _fetch_all(entry, files, source.open, tracker)
        version = source.version()
        # Partial copies of objects replaced meanwhile are never continued: drop them.
        shutil.rmtree(entry.partial_directory, ignore_errors=True)
    finally:
        source.close()
    return _complete(args, entry, version, total, fetched, files)


def _complete(
    args: argparse.Namespace,
    entry: Entry,
    commit: str,
    total: int,
    fetched: int,
    files: Sequence[RemoteFile],
) -> FetchResult:
    """The entry's result, recorded as complete in the cache."""
    result = FetchResult(
        source=args.source,
        revision=args.revision,
        commit=commit,
        path=str(entry.directory.relative_to(args.cache)),
        bytes_total=total,
        bytes_fetched=fetched,
        files=[record_of(f) for f in files],
    )
    mark_complete(args.cache, entry.key, result)
    return result


def _write_outcome(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        print(f"fetch: cannot write the result to {path}: {exc}", file=sys.stderr)


def fetch_main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tracker = Tracker(args.max_bytes_per_second)
    server = _serve_progress(tracker, args.host, args.port) if args.port else None
    started = time.monotonic()
    try:
        if args.source.startswith("hf://"):
            result = fetch_hub(args, tracker)
        elif args.source.startswith("s3://"):
            result = fetch_s3(args, tracker)
        else:
            raise FetchFailed("InvalidSource", f"{args.source}: expected hf:// or s3://")
    except FetchFailed as failed:
        failure: FetchFailure = failed.failure
        print(f"fetch: failed ({failure.reason}): {failure.message}", file=sys.stderr)
        _write_outcome(args.result_file, failure.to_json())
        return PERMANENT_EXIT if failure.permanent else TRANSIENT_EXIT
    finally:
        if server is not None:
            server.shutdown()
    print(
        f"fetch: {result.source}@{result.revision} ({result.commit}) complete: "
        f"{result.bytes_total} bytes in {len(result.files)} files, {result.bytes_fetched} "
        f"transferred in {time.monotonic() - started:.1f} s",
        flush=True,
    )
    _write_outcome(args.result_file, result.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(fetch_main())
