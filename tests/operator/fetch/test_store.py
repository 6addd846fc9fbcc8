"""The cache on disk: verified, resumable copies in the hub and plain-directory layouts."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from davit_operator.fetch.result import FetchFailed, FetchResult
from davit_operator.fetch.store import (
    Checksum,
    DirectoryEntry,
    HubEntry,
    RemoteFile,
    entry_key,
    fetch_file,
    mark_complete,
    read_marker,
    record_of,
)

CONTENT = bytes(range(256)) * 4096  # 1 MiB, chunks below cross no obvious boundary
COMMIT = "c0ffee" * 6 + "abcd"


class Counter:
    def __init__(self) -> None:
        self.total = 0

    def add(self, n: int) -> None:
        self.total += n


class Source:
    """Serves `content` in 100,000-byte chunks from the requested offset, or from 0 when it
    ignores ranges; `fail_after` bytes cut the transfer as a dropped connection would."""

    def __init__(
        self, content: bytes, *, honours_range: bool = True, fail_after: int | None = None
    ) -> None:
        self.content = content
        self.honours_range = honours_range
        self.fail_after = fail_after
        self.offsets: list[int] = []

    def __call__(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        self.offsets.append(offset)
        start = offset if self.honours_range else 0
        data = self.content[start:]

        def chunks() -> Iterator[bytes]:
            sent = 0
            for i in range(0, len(data), 100_000):
                chunk = data[i : i + 100_000]
                if self.fail_after is not None and sent + len(chunk) > self.fail_after:
                    yield chunk[: self.fail_after - sent]
                    raise FetchFailed("Transient", "connection reset")
                sent += len(chunk)
                yield chunk

        return start, chunks()


def sha256(data: bytes) -> Checksum:
    return Checksum("sha256", hashlib.sha256(data).hexdigest())


def hub_file(data: bytes = CONTENT, path: str = "model.safetensors") -> RemoteFile:
    return RemoteFile(path, len(data), sha256(data))


def hub_entry(tmp_path: Path) -> HubEntry:
    return HubEntry(tmp_path, "Org/Model", "main", COMMIT)


def test_a_fresh_file_is_verified_then_published_in_the_hub_layout(tmp_path: Path) -> None:
    entry, file, counter = hub_entry(tmp_path), hub_file(), Counter()
    assert fetch_file(entry, file, Source(CONTENT), counter) == len(CONTENT)
    assert counter.total == len(CONTENT)
    blob = tmp_path / "hf" / "models--Org--Model" / "blobs" / file.checksum.hexdigest  # type: ignore[union-attr]
    assert blob.read_bytes() == CONTENT
    assert not blob.with_name(blob.name + ".incomplete").exists()
    link = tmp_path / "hf" / "models--Org--Model" / "snapshots" / COMMIT / "model.safetensors"
    assert link.is_symlink() and not os.readlink(link).startswith("/")
    assert link.read_bytes() == CONTENT
    entry.write_ref()
    assert (tmp_path / "hf" / "models--Org--Model" / "refs" / "main").read_text() == COMMIT


def test_a_complete_file_is_not_fetched_again(tmp_path: Path) -> None:
    entry, file = hub_entry(tmp_path), hub_file()
    fetch_file(entry, file, Source(CONTENT), Counter())
    source, counter = Source(CONTENT), Counter()
    assert fetch_file(entry, file, source, counter) == 0
    assert source.offsets == [] and counter.total == len(CONTENT)


def test_an_interrupted_file_resumes_from_its_partial_copy(tmp_path: Path) -> None:
    entry, file = hub_entry(tmp_path), hub_file()
    with pytest.raises(FetchFailed) as err:
        fetch_file(entry, file, Source(CONTENT, fail_after=450_000), Counter())
    assert err.value.failure.reason == "Transient"
    partial = entry.partial_path(file)
    assert partial.stat().st_size == 450_000 and not entry.final_path(file).exists()
    source, counter = Source(CONTENT), Counter()
    transferred = fetch_file(entry, file, source, counter)
    assert source.offsets == [450_000]
    assert transferred == len(CONTENT) - 450_000
    assert counter.total == len(CONTENT)  # the resumed part counts as done
    assert entry.final_path(file).read_bytes() == CONTENT and not partial.exists()


def test_a_source_that_ignores_the_range_restarts_the_file(tmp_path: Path) -> None:
    entry, file = hub_entry(tmp_path), hub_file()
    with pytest.raises(FetchFailed):
        fetch_file(entry, file, Source(CONTENT, fail_after=300_000), Counter())
    counter = Counter()
    transferred = fetch_file(entry, file, Source(CONTENT, honours_range=False), counter)
    assert transferred == len(CONTENT) and counter.total == len(CONTENT)
    assert entry.final_path(file).read_bytes() == CONTENT


def test_wrong_content_is_discarded_and_named(tmp_path: Path) -> None:
    entry, file = hub_entry(tmp_path), hub_file()
    damaged = bytearray(CONTENT)
    damaged[123_456] ^= 0x01
    with pytest.raises(FetchFailed) as err:
        fetch_file(entry, file, Source(bytes(damaged)), Counter())
    failure = err.value.failure
    assert failure.reason == "ChecksumMismatch" and failure.permanent
    assert "model.safetensors" in failure.message and file.checksum.hexdigest in failure.message  # type: ignore[union-attr]
    assert not entry.partial_path(file).exists() and not entry.final_path(file).exists()
    assert not (tmp_path / "hf" / "models--Org--Model" / "snapshots" / COMMIT).exists()


def test_a_damaged_partial_copy_fails_the_check_after_resuming(tmp_path: Path) -> None:
    """Resumption hashes the bytes already on disk: a partial copy damaged there is caught."""
    entry, file = hub_entry(tmp_path), hub_file()
    partial = entry.partial_path(file)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\0" * 200_000)
    with pytest.raises(FetchFailed) as err:
        fetch_file(entry, file, Source(CONTENT), Counter())
    assert err.value.failure.reason == "ChecksumMismatch"
    assert not partial.exists()  # the next attempt starts clean
    assert fetch_file(entry, file, Source(CONTENT), Counter()) == len(CONTENT)


def test_sizes_that_disagree_with_the_listing(tmp_path: Path) -> None:
    entry = hub_entry(tmp_path)
    longer = RemoteFile("a.json", 10, None)
    with pytest.raises(FetchFailed) as err:
        fetch_file(entry_dir(tmp_path), longer, Source(b"x" * 11), Counter())
    assert err.value.failure.reason == "ChecksumMismatch"
    shorter = hub_file(b"y" * 10, "b.json")
    source = Source(b"y" * 4)
    with pytest.raises(FetchFailed) as err:
        fetch_file(entry, shorter, source, Counter())
    assert err.value.failure.reason == "Transient"
    assert entry.partial_path(shorter).stat().st_size == 4  # kept, to resume


def test_git_blob_ids_are_checked_as_git_computes_them(tmp_path: Path) -> None:
    data = b'{"bos_token_id": 1, "eos_token_id": 2}\n'
    (tmp_path / "f").write_bytes(data)
    oid = subprocess.run(
        ["git", "hash-object", str(tmp_path / "f")], check=True, capture_output=True, text=True
    ).stdout.strip()
    file = RemoteFile("generation_config.json", len(data), Checksum("git-sha1", oid))
    entry = hub_entry(tmp_path / "cache")
    fetch_file(entry, file, Source(data), Counter())
    assert (entry.directory / "generation_config.json").read_bytes() == data
    assert entry.final_path(file).name == oid


def test_single_part_etags_are_md5s(tmp_path: Path) -> None:
    data = b"tokenizer" * 1000
    good = RemoteFile("tokenizer.json", len(data), Checksum("md5", hashlib.md5(data).hexdigest()))
    entry = entry_dir(tmp_path)
    fetch_file(entry, good, Source(data), Counter())
    assert (entry.directory / "tokenizer.json").read_bytes() == data
    bad = RemoteFile("config.json", len(data), Checksum("md5", "0" * 32))
    with pytest.raises(FetchFailed) as err:
        fetch_file(entry, bad, Source(data), Counter())
    assert err.value.failure.reason == "ChecksumMismatch"
    assert record_of(good).checksum == f"md5:{hashlib.md5(data).hexdigest()}"
    assert record_of(RemoteFile("x", 1, None)).checksum == "size"


def entry_dir(tmp_path: Path) -> DirectoryEntry:
    return DirectoryEntry(tmp_path, "s3", "bucket/models/smol", "r1")


def test_a_replaced_object_never_continues_the_old_partial_copy(tmp_path: Path) -> None:
    entry = entry_dir(tmp_path)
    old = RemoteFile("model.safetensors", len(CONTENT), None, version="etag-1-2")
    with pytest.raises(FetchFailed):
        fetch_file(entry, old, Source(CONTENT, fail_after=500_000), Counter())
    new_content = CONTENT[::-1]
    new = RemoteFile("model.safetensors", len(new_content), None, version="etag-2-2")
    assert entry.partial_path(new) != entry.partial_path(old)
    source = Source(new_content)
    assert fetch_file(entry, new, source, Counter()) == len(new_content)
    assert source.offsets == [0]
    assert (entry.directory / "model.safetensors").read_bytes() == new_content
    assert entry.partial_path(old).exists()  # left for the fetcher to drop at the end


def test_paths_from_the_source_stay_inside_the_entry(tmp_path: Path) -> None:
    for path in ("../escape.safetensors", "/etc/passwd", "a/../../b"):
        with pytest.raises(FetchFailed) as err:
            fetch_file(entry_dir(tmp_path), RemoteFile(path, 1, None), Source(b"x"), Counter())
        assert err.value.failure.reason == "InvalidSource"
    assert not (tmp_path.parent / "escape.safetensors").exists()


def test_a_full_volume_is_disk_full(tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    entry, file = hub_entry(tmp_path), hub_file()
    partial = entry.partial_path(file)
    partial.parent.mkdir(parents=True)
    partial.symlink_to("/dev/full")  # every write there fails with ENOSPC
    with pytest.raises(FetchFailed) as err:
        fetch_file(entry, file, Source(CONTENT), Counter())
    assert err.value.failure.reason == "DiskFull" and err.value.failure.permanent
    assert "full" in err.value.failure.message


def test_entry_keys_name_one_source_at_one_revision() -> None:
    key = entry_key("hf", "Org/Model", "main")
    assert key == entry_key("hf", "Org/Model", "main") and len(key) == 16
    others = {
        entry_key("hf", "Org/Model", "v2"),
        entry_key("hf", "Org/Other", "main"),
        entry_key("s3", "Org/Model", "main"),
    }
    assert key not in others and len(others) == 3
    assert HubEntry(Path("/c"), "Org/Model", "main", COMMIT).key == key
    assert DirectoryEntry(Path("/c"), "s3", "b/p", "r1").key == entry_key("s3", "b/p", "r1")


def test_the_completion_marker_is_the_result(tmp_path: Path) -> None:
    assert read_marker(tmp_path, "k") is None
    result = FetchResult(
        source="hf://Org/Model",
        revision="main",
        commit=COMMIT,
        path="hf/models--Org--Model/snapshots/" + COMMIT,
        bytes_total=10,
        bytes_fetched=4,
    )
    mark_complete(tmp_path, "k", result)
    marker = read_marker(tmp_path, "k")
    assert marker is not None and marker["commit"] == COMMIT and marker["bytes_fetched"] == 4
    assert not list((tmp_path / ".davit" / "entries").glob("*.tmp"))
