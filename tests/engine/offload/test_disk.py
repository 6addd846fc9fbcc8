"""The disk tier's files and index: round trip, every kind of damage, the startup scan and the
byte capacity."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from davit_engine.offload import disk as disk_io
from davit_engine.offload.disk import HEADER_BYTES, DiskIndex, ReadStatus

IDENTITY = bytes(range(16))
OTHER = bytes(range(1, 17))
BLOCK = 4096


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def write(path: Path, block_hash: bytes, data: np.ndarray, identity: bytes = IDENTITY) -> None:
    disk_io.write_block(path, disk_io.encode_header(identity, block_hash, data), data)


def test_round_trip(tmp_path: Path) -> None:
    data, h = payload(1), b"h" * 16
    write(tmp_path / "a" / "x.kvb", h, data)
    out = np.zeros(BLOCK, dtype=np.uint8)
    assert disk_io.read_block(tmp_path / "a" / "x.kvb", IDENTITY, h, out) is ReadStatus.OK
    assert np.array_equal(out, data)
    assert not list((tmp_path / "a").glob("*.tmp"))


@pytest.mark.parametrize(
    ("damage", "status"),
    [
        ("flip_payload", ReadStatus.CORRUPT),
        ("flip_magic", ReadStatus.CORRUPT),
        ("truncate_payload", ReadStatus.TRUNCATED),
        ("truncate_header", ReadStatus.TRUNCATED),
        ("append", ReadStatus.CORRUPT),
        ("other_identity", ReadStatus.FOREIGN),
        ("other_block", ReadStatus.FOREIGN),
        ("other_size", ReadStatus.FOREIGN),
        ("missing", ReadStatus.MISSING),
        ("directory", ReadStatus.IO_ERROR),
    ],
)
def test_damaged_files_are_refused(tmp_path: Path, damage: str, status: ReadStatus) -> None:
    path, h, data = tmp_path / "b.kvb", b"k" * 16, payload(2)
    out = np.zeros(BLOCK, dtype=np.uint8)
    write(path, h, data, OTHER if damage == "other_identity" else IDENTITY)
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":
        raw[HEADER_BYTES + 100] ^= 0x01
    elif damage == "flip_magic":
        raw[0] ^= 0xFF
    elif damage == "truncate_payload":
        raw = raw[: HEADER_BYTES + BLOCK // 2]
    elif damage == "truncate_header":
        raw = raw[:20]
    elif damage == "append":
        raw += b"\x00"
    path.write_bytes(bytes(raw))
    if damage == "other_block":
        h = b"j" * 16
    elif damage == "other_size":
        out = np.zeros(BLOCK * 2, dtype=np.uint8)
    elif damage == "missing":
        path.unlink()
    elif damage == "directory":
        path.unlink()
        path.mkdir()
    assert disk_io.read_block(path, IDENTITY, h, out) is status


def make_index(root: Path, capacity_blocks: int) -> DiskIndex:
    return DiskIndex(
        str(root),
        {"test": 1},
        IDENTITY,
        capacity_blocks * (HEADER_BYTES + BLOCK),
        HEADER_BYTES + BLOCK,
    )


def test_scan_orders_by_last_use_and_cleans_up(tmp_path: Path) -> None:
    index = make_index(tmp_path, 10)
    hashes = [bytes([i]) * 16 for i in range(4)]
    now = time.time()
    for i, h in enumerate(hashes):
        write(index.path(h), h, payload(i))
        os.utime(index.path(h), (now - 100 + i, now - 100 + i))
    os.utime(index.path(hashes[0]), (now, now))  # used last
    (index.path(hashes[1]).parent / "junk.kvb.tmp").write_bytes(b"partial")
    wrong = index.folder / "ff" / ("ff" * 16 + ".kvb")
    wrong.parent.mkdir(parents=True, exist_ok=True)
    wrong.write_bytes(b"short")
    (tmp_path / ("ab" * 16)).mkdir()  # another identity's folder: left alone
    again = make_index(tmp_path, 10)
    assert again.hashes() == [hashes[1], hashes[2], hashes[3], hashes[0]]
    assert not wrong.exists() and not list(index.folder.rglob("*.tmp"))
    assert (tmp_path / ("ab" * 16)).is_dir()
    assert (index.folder / "identity.json").is_file()


def test_scan_enforces_a_smaller_capacity(tmp_path: Path) -> None:
    index = make_index(tmp_path, 10)
    hashes = [bytes([i]) * 16 for i in range(5)]
    now = time.time()
    for i, h in enumerate(hashes):
        write(index.path(h), h, payload(i))
        os.utime(index.path(h), (now + i, now + i))
    smaller = make_index(tmp_path, 3)
    assert smaller.hashes() == hashes[2:]
    assert not index.path(hashes[0]).exists() and not index.path(hashes[1]).exists()


def test_reserve_evicts_least_recent_unpinned(tmp_path: Path) -> None:
    index = make_index(tmp_path, 2)
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    for h in (a, b):
        assert index.reserve() == []
        index.finish_write(h, ok=True)
    index.pin(a)
    assert index.reserve() == [index.path(b)]  # a is being read: b goes
    index.finish_write(c, ok=True)
    assert index.hashes() == [a, c]
    index.pin(c)
    assert index.reserve() is None  # both in use
    index.unpin(a)
    assert index.reserve() == [index.path(a)]
    index.finish_write(b, ok=False)
    assert index.hashes() == [c] and index.reserved_bytes == 0
