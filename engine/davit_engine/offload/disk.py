"""The disk tier: one checksummed file per KV block under a folder per identity, LRU by use.

Layout: `<root>/<identity hex>/<first byte of the block hash, hex>/<block hash hex>.kvb`, plus
`<root>/<identity hex>/identity.json` saying what the folder holds. A file is a 64-byte header
(magic, format, identity digest, block hash, payload length, CRC-32 of the payload) followed by
the block's byte image. Files are written to a temporary name and renamed, so a crash leaves
either the old state or a complete file (a torn write is caught by the checksum anyway).

The index (which blocks are on disk, their sizes, least recently used first) lives in memory,
rebuilt at startup by scanning the folder (modification time = last use) and updated by the
engine loop only; the reads, writes and removals themselves run on worker threads and never
touch it. Every failure is a miss: a file that is gone, short, foreign (another identity or
block in its header), damaged (checksum) or unreadable is dropped from the index with a warning
and the block is computed instead; a write that fails (disk full, I/O error) stores nothing.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import os
import struct
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from davit_contract.kv_offload import DISK_FILE_HEADER_BYTES

logger = logging.getLogger(__name__)

MAGIC = b"DAVITKV\x00"
_HEADER = struct.Struct("<8sI16s16sQI")  # magic, format, identity, block hash, length, crc32
HEADER_BYTES = DISK_FILE_HEADER_BYTES
SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"
# Warnings about one kind of failure are logged at most this often (a dying disk would
# otherwise log one line per block).
_WARN_INTERVAL_S = 30.0


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    TRUNCATED = "truncated"
    FOREIGN = "foreign"
    CORRUPT = "corrupt"
    IO_ERROR = "io_error"


def encode_header(identity: bytes, block_hash: bytes, payload: np.ndarray) -> bytes:
    crc = zlib.crc32(payload.data)
    header = _HEADER.pack(MAGIC, 1, identity, block_hash, payload.nbytes, crc)
    return header.ljust(HEADER_BYTES, b"\x00")


def write_block(path: Path, header: bytes, payload: np.ndarray) -> None:
    """Write one block file (worker thread): a temporary file, then an atomic rename. Raises
    OSError (ENOSPC for a full disk); the temporary file is removed then."""
    # Named per process: engines sharing a folder may write the same block at once.
    tmp = path.with_name(f"{path.name}.{os.getpid()}{_TMP_SUFFIX}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            _write_all(fd, header)
            _write_all(fd, payload.data.cast("B"))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def read_block(path: Path, identity: bytes, block_hash: bytes, out: np.ndarray) -> ReadStatus:
    """Read one block file into `out` (a uint8 array of the block's size; worker thread) and
    check it: header, length, identity, block and checksum."""
    try:
        with open(path, "rb", buffering=0) as f:
            header = f.read(HEADER_BYTES)
            if len(header) < HEADER_BYTES:
                return ReadStatus.TRUNCATED
            magic, version, file_identity, file_hash, length, crc = _HEADER.unpack_from(header)
            if magic != MAGIC or version != 1:
                return ReadStatus.CORRUPT
            if file_identity != identity or file_hash != block_hash or length != out.nbytes:
                return ReadStatus.FOREIGN
            view = out.data.cast("B")
            got = 0
            while got < length:
                n = f.readinto(view[got:])
                if not n:
                    return ReadStatus.TRUNCATED
                got += n
            if f.read(1):
                return ReadStatus.CORRUPT  # longer than its header says
    except FileNotFoundError:
        return ReadStatus.MISSING
    except OSError:
        return ReadStatus.IO_ERROR
    if zlib.crc32(out.data) != crc:
        return ReadStatus.CORRUPT
    return ReadStatus.OK


def touch(path: Path) -> None:
    """Mark a file used now (its modification time orders the LRU after a restart)."""
    with contextlib.suppress(OSError):  # gone or read-only: the order is only a hint
        os.utime(path)


def remove(path: Path) -> None:
    with contextlib.suppress(OSError):  # already gone
        path.unlink()


class DiskIndex:
    """Which blocks of one identity are on disk, least recently used first, within a byte
    capacity. Engine-loop thread only; file I/O goes through the functions above."""

    def __init__(
        self,
        root: str,
        identity: dict[str, Any],
        digest: bytes,
        capacity_bytes: int,
        file_bytes: int,
    ) -> None:
        self.root = Path(root)
        self.folder = self.root / digest.hex()
        self.digest = digest
        self.capacity_bytes = capacity_bytes
        self.file_bytes = file_bytes
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self.reserved_bytes = 0  # writes under way
        self._last_warning: dict[str, float] = {}
        self.folder.mkdir(parents=True, exist_ok=True)
        note = self.folder / "identity.json"
        if not note.exists():
            note.write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")
        self._scan()

    # ---- state ---------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return len(self._lru) * self.file_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._lru)

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.file_bytes

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def path(self, block_hash: bytes) -> Path:
        hexed = block_hash.hex()
        return self.folder / hexed[:2] / (hexed + SUFFIX)

    def hashes(self) -> list[bytes]:
        return list(self._lru)

    # ---- engine-loop updates ---------------------------------------------------------------

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)

    def pin(self, block_hash: bytes) -> None:
        self._pins[block_hash] = self._pins.get(block_hash, 0) + 1

    def unpin(self, block_hash: bytes) -> None:
        left = self._pins[block_hash] - 1
        if left:
            self._pins[block_hash] = left
        else:
            del self._pins[block_hash]

    def reserve(self) -> list[Path] | None:
        """Room for one more file: the files to remove (least recently used, not being read)
        to make it, or None when it cannot be made."""
        victims: list[bytes] = []
        need = self.used_bytes + self.reserved_bytes + self.file_bytes - self.capacity_bytes
        for block_hash in self._lru:
            if need <= 0:
                break
            if block_hash not in self._pins:
                victims.append(block_hash)
                need -= self.file_bytes
        if need > 0:
            return None
        for block_hash in victims:
            del self._lru[block_hash]
        self.reserved_bytes += self.file_bytes
        return [self.path(block_hash) for block_hash in victims]

    def finish_write(self, block_hash: bytes, ok: bool) -> None:
        self.reserved_bytes -= self.file_bytes
        if ok:
            self._lru[block_hash] = None
            self._lru.move_to_end(block_hash)

    def forget(self, block_hash: bytes) -> None:
        """Drop a block whose file failed to read (its file is removed by the caller)."""
        self._lru.pop(block_hash, None)

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(kind, -_WARN_INTERVAL_S) >= _WARN_INTERVAL_S:
            self._last_warning[kind] = now
            logger.warning("KV disk tier: " + message, *args)

    # ---- startup ---------------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the folder: complete files of the right size, oldest use
        first; temporary files of an interrupted write and misfit files are removed."""
        found: list[tuple[float, bytes]] = []
        removed = 0
        for sub in self.folder.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                name = entry.name
                if not name.endswith(SUFFIX):
                    if name.endswith(_TMP_SUFFIX):
                        remove(Path(entry.path))
                    continue
                try:
                    block_hash = bytes.fromhex(name.removesuffix(SUFFIX))
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                if stat.st_size != self.file_bytes or len(block_hash) != 16:
                    remove(Path(entry.path))
                    removed += 1
                    continue
                found.append((stat.st_mtime, block_hash))
        found.sort()
        for _, block_hash in found:
            self._lru[block_hash] = None
        over = self.used_bytes - self.capacity_bytes
        while over > 0 and self._lru:
            block_hash, _ = self._lru.popitem(last=False)
            remove(self.path(block_hash))
            over -= self.file_bytes
        if removed:
            logger.warning(
                "KV disk tier: removed %d files of the wrong size under %s", removed, self.folder
            )
        others = [p.name for p in self.root.iterdir() if p.is_dir() and p != self.folder]
        logger.info(
            "KV disk tier: %d blocks (%.2f GiB) found under %s%s",
            len(self._lru),
            self.used_bytes / 2**30,
            self.folder,
            f"; other identities' folders left alone: {', '.join(sorted(others))}"
            if others
            else "",
        )


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
