"""The KV tiers below the GPU prefix cache: host memory (LRU), then disk (LRU), write-through.

Stores. Every block the prefix cache registers as full is queued; the queue is copied to host
slots in batches (`flush`, before a step launches) and at the latest before a queued block is
reused or loaded into, so a GPU block that drops out of the prefix cache is already below it
and its eviction costs nothing. With a CPU tier the copy joins that tier as its most recently
used block; a block the CPU tier evicts is written to disk on a worker thread (when the disk
tier exists and its writes keep up; otherwise it is dropped). Without a CPU tier the host slot
is only a bounce buffer on the way to disk.

Loads. `load()` pins each block where it is (a CPU slot, or a disk file read into a bounce slot
on a worker thread), and once every read has come back, copies the intact prefix into the GPU
blocks in one batch. The scheduler learns about finished loads by polling (`finished_loads`).
On CUDA a load is finished for the scheduler as soon as its copies are queued: the next step
that launches waits for them on the GPU (`flush` makes the runner's stream wait on the load's
event), so a returning request joins the very next step instead of the first step after the
host saw the copies end. Its host slots stay pinned until the copies have run; a block read from
disk then joins the CPU tier. Nothing here blocks the engine loop except `wait()`, called only
when nothing else can run.

Engine-loop thread only, except the file operations on the worker threads, which touch no
state here and report through their futures.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from davit_engine.core.kv_tiers import LowerTiers
from davit_engine.offload import disk as disk_io
from davit_engine.offload.disk import DiskIndex, ReadStatus
from davit_engine.offload.host_pool import HostPool
from davit_engine.offload.mover import Mover
from davit_engine.types import KV_TIER_LOAD_BUCKETS, KvTierStats

logger = logging.getLogger(__name__)

# Queued stores are copied once a staging buffer's worth waits, or this many steps after the
# last copy.
FLUSH_STEPS = 8
# Disk writes under way at most: a CPU-tier block evicted beyond that is dropped, not written,
# so a slow disk never holds host slots hostage.
MAX_DISK_WRITES = 256
# Threads reading and threads writing block files: apart, so reads never queue behind writes
# that a slow or full disk holds up.
DISK_READERS = 4
DISK_WRITERS = 4


@dataclass
class _Part:
    block_hash: bytes
    block_id: int
    slot: int
    read: Future[ReadStatus] | None = None  # a disk read into the slot, None: already there
    # Already in host memory as a disk-tier block on its way to disk (a write under way), not
    # as a CPU-tier block: the load counts as the disk tier's.
    writing: bool = False


@dataclass
class _Load:
    load_id: int
    parts: list[_Part]
    started: float
    event: torch.cuda.Event | None = None
    issued: bool = False  # the host-to-GPU copy of the intact prefix was launched
    num_intact: int = 0


@dataclass
class _Write:
    block_hash: bytes
    slot: int
    future: Future[None]


class KvTiers(LowerTiers):
    """See the module docstring. `cpu_blocks` may be 0 (disk only) and `disk` None (CPU only)."""

    def __init__(
        self,
        mover: Mover,
        pool: HostPool,
        block_size: int,
        cpu_blocks: int,
        disk: DiskIndex | None,
    ) -> None:
        self.mover = mover
        self.pool = pool
        self.block_size = block_size
        self.block_bytes = pool.block_bytes
        self.cpu_blocks = cpu_blocks
        self.disk = disk
        self._cpu: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self._slot_hash: dict[int, bytes] = {}  # CPU-tier slots
        self._queued: dict[int, bytes] = {}  # GPU block id -> hash, not copied yet
        self._due: set[int] = set()  # queued blocks that must be copied before the next step
        self._steps_since_flush = 0
        self._writing: dict[bytes, int] = {}  # hash -> slot, disk write under way
        self._writes: list[_Write] = []
        self._loads: dict[int, _Load] = {}  # reading from disk, or copies not yet queued
        # Loads whose copies are queued and reported finished, holding their host slots until
        # the copies have run.
        self._copying: dict[int, _Load] = {}
        # Events of queued loads that no step has waited for yet (see `flush`).
        self._unwaited: list[torch.cuda.Event] = []
        self._finished: list[tuple[int, int]] = []
        self._readers = (
            ThreadPoolExecutor(DISK_READERS, thread_name_prefix="kv-disk-read") if disk else None
        )
        self._writers = (
            ThreadPoolExecutor(DISK_WRITERS, thread_name_prefix="kv-disk-write") if disk else None
        )
        self.cpu_stats = KvTierStats("cpu", capacity_bytes=cpu_blocks * self.block_bytes)
        self.disk_stats = KvTierStats("disk", capacity_bytes=disk.capacity_bytes if disk else 0)
        self._closed = False
        # Without a CPU tier every host slot is a bounce buffer: half of them stay for reads.
        self.read_reserve = 0 if cpu_blocks else pool.num_slots // 2
        self.info: dict[str, Any] = {}  # the configuration as reported (see offload_info)

    # ---- LowerTiers -------------------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        bs = self.block_size
        if self.cpu_blocks:
            if block_hash in self._cpu or block_hash in self._writing:
                self.cpu_stats.hits += bs
                return True
            self.cpu_stats.misses += bs
        if self.disk is not None:
            if block_hash in self.disk or block_hash in self._writing:
                self.disk_stats.hits += bs
                return True
            self.disk_stats.misses += bs
        return False

    def store(self, block_hash: bytes, block_id: int) -> None:
        slot = self._cpu.get(block_hash)
        if slot is not None:
            self._cpu.move_to_end(block_hash)
            return
        if block_hash in self._writing:
            return
        if not self.cpu_blocks and self.disk is not None and block_hash in self.disk:
            self.disk.touch(block_hash)
            return
        self._queued[block_id] = block_hash

    def block_reused(self, block_id: int) -> None:
        if block_id in self._queued:
            self._due.add(block_id)

    def discard_stores(self) -> None:
        self._queued.clear()
        self._due.clear()

    def load(self, load_id: int, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        reused = [b for b in block_ids if b in self._queued]
        if reused:
            self._due.update(reused)
            self._flush_now()  # their previous contents are copied before the load lands
        parts: list[_Part] = []
        for block_hash, block_id in zip(block_hashes, block_ids, strict=False):
            slot = self._cpu.get(block_hash)
            writing = slot is None
            if slot is None:
                slot = self._writing.get(block_hash)
            else:
                self._cpu.move_to_end(block_hash)
            if slot is not None:
                self.pool.pin(slot)
                parts.append(_Part(block_hash, block_id, slot, writing=writing))
                continue
            if self.disk is None or block_hash not in self.disk:
                break
            slot = self._free_slot()
            if slot is None:
                break
            assert self._readers is not None
            self.pool.pin(slot)
            self.disk.pin(block_hash)
            self.disk.touch(block_hash)
            read = self._readers.submit(
                _read_job,
                self.disk.path(block_hash),
                self.disk.digest,
                block_hash,
                self.pool.array(slot),
                self.pool.ready[slot],
            )
            parts.append(_Part(block_hash, block_id, slot, read))
        if not parts:
            return 0
        load = _Load(load_id, parts, time.perf_counter())
        self._loads[load_id] = load
        if all(p.read is None for p in parts):
            self._issue(load, len(parts))
        return len(parts)

    def finished_loads(self) -> list[tuple[int, int]]:
        self.poll()
        done, self._finished = self._finished, []
        return done

    def wait(self, timeout_s: float) -> None:
        """Block until a load can be reported to the scheduler (or a write is done), at most
        about `timeout_s`; at once when one can be already."""
        if self._finished:
            return
        reads = [p.read for load in self._loads.values() for p in load.parts if p.read is not None]
        pending = [r for r in reads if not r.done()]
        if pending:
            wait_futures(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)
            return
        for load in self._loads.values():
            if load.event is not None:
                load.event.synchronize()
                return
        if self._writes:
            wait_futures(
                [w.future for w in self._writes], timeout=timeout_s, return_when=FIRST_COMPLETED
            )

    # ---- stores -------------------------------------------------------------------------------

    def flush(self) -> None:
        """Copy the queued blocks when they are due (called before each step launches)."""
        if self._unwaited:
            # Loads reported finished: this step and every later one run after their copies
            # (the step may read those blocks, or reuse one whose scatter is still queued).
            stream = torch.cuda.current_stream(self.mover.image.device)
            for event in self._unwaited:
                stream.wait_event(event)
            self._unwaited.clear()
        self._steps_since_flush += 1
        if self._queued and (
            self._due
            or len(self._queued) >= self.mover.chunk
            or self._steps_since_flush >= FLUSH_STEPS
        ):
            self._flush_now()
        if self._writes or self._loads or self._copying:
            self.poll()

    def _flush_now(self) -> None:
        """Copy the queued blocks, in batches no larger than the CPU tier (a later batch may
        evict an earlier one, whose copy is then launched already). A block that finds no
        host slot stays queued for the next flush unless it is due now (reused or loaded
        into), then it is dropped."""
        queued = list(self._queued.items())
        self._queued = {}
        due, self._due = self._due, set()
        self._steps_since_flush = 0
        batch_size = min(self.mover.chunk, self.cpu_blocks) if self.cpu_blocks else self.mover.chunk
        for start in range(0, len(queued), batch_size):
            rest = queued[start:]
            if not self.mover.can_store() and not any(b in due for b, _ in rest):
                # Every staging buffer still drains to the host: the rest waits for the next
                # flush rather than the host for the copies (nothing of it is due yet).
                self._queued.update(rest)
                self._due |= due & self._queued.keys()
                return
            self._store_batch(queued[start : start + batch_size], due)

    def _store_batch(self, items: list[tuple[int, bytes]], due: set[int]) -> None:
        block_ids: list[int] = []
        slots: list[int] = []
        hashes: list[bytes] = []
        for block_id, block_hash in items:
            if block_hash in self._cpu or block_hash in self._writing:
                continue  # stored from another GPU block meanwhile
            slot = self._slot_for_store(len(hashes))
            if slot is None:
                if block_id in due:
                    (self.cpu_stats if self.cpu_blocks else self.disk_stats).dropped_stores += 1
                else:
                    self._queued[block_id] = block_hash  # host slots are busy: next time
                continue
            block_ids.append(block_id)
            slots.append(slot)
            hashes.append(block_hash)
        if not block_ids:
            return
        event = self.mover.store(block_ids, slots)
        for block_hash, slot in zip(hashes, slots, strict=True):
            self.pool.ready[slot] = event
            if self.cpu_blocks:
                self._cpu[block_hash] = slot
                self._slot_hash[slot] = block_hash
            else:
                self._write_to_disk(block_hash, slot)
        if self.cpu_blocks:
            self.cpu_stats.store_bytes += len(block_ids) * self.block_bytes

    def _slot_for_store(self, num_joining: int) -> int | None:
        """A slot for a block joining the CPU tier after `num_joining` others of this batch;
        without a CPU tier, a bounce slot for its way to disk, but never one of the last
        `read_reserve` free slots: writes that back up behind a slow disk must not take the
        slots a returning prefix needs to be read (it would be computed again instead)."""
        if not self.cpu_blocks:
            return self.pool.take() if self.pool.num_free > self.read_reserve else None
        while len(self._cpu) + num_joining >= self.cpu_blocks:
            if not self._evict_cpu():
                return None
        return self._free_slot()

    def _free_slot(self) -> int | None:
        slot = self.pool.take()
        while slot is None:
            if not self._evict_cpu():
                return None
            slot = self.pool.take()
        return slot

    def _evict_cpu(self) -> bool:
        """Evict the least recently used CPU-tier block that no load reads: to disk when the
        disk tier takes it, else dropped. False when every block is in use."""
        for block_hash, slot in self._cpu.items():
            if self.pool.pins[slot]:
                continue
            del self._cpu[block_hash]
            del self._slot_hash[slot]
            disk = self.disk
            if disk is not None and block_hash not in disk and len(self._writes) < MAX_DISK_WRITES:
                self._write_to_disk(block_hash, slot)
            else:
                if disk is not None and block_hash not in disk:
                    self.disk_stats.dropped_stores += 1
                self.pool.give_back(slot)
            return True
        return False

    def _write_to_disk(self, block_hash: bytes, slot: int) -> None:
        disk = self.disk
        assert disk is not None and self._writers is not None
        victims = disk.reserve()
        if victims is None:  # every file is being read: nothing can make room now
            self.disk_stats.dropped_stores += 1
            self._release(slot)
            return
        self.pool.pin(slot)
        self._writing[block_hash] = slot
        future = self._writers.submit(
            _write_job,
            disk.path(block_hash),
            disk.digest,
            block_hash,
            self.pool.array(slot),
            self.pool.ready[slot],
            victims,
        )
        self._writes.append(_Write(block_hash, slot, future))

    def _release(self, slot: int) -> None:
        """A slot nobody uses any more goes back unless it holds a CPU-tier block."""
        if not self.pool.pins[slot] and slot not in self._slot_hash:
            self.pool.give_back(slot)

    # ---- completion -------------------------------------------------------------------------

    def poll(self) -> None:
        """Apply finished disk writes and advance loads (engine loop, between steps)."""
        if self._writes:
            self._reap_writes()
        for load in list(self._loads.values()):
            self._advance(load)
        for load in list(self._copying.values()):
            if load.event is None or load.event.query():
                self._land(load)

    def _reap_writes(self) -> None:
        disk = self.disk
        assert disk is not None
        remaining: list[_Write] = []
        for write in self._writes:
            if not write.future.done():
                remaining.append(write)
                continue
            exc = write.future.exception()
            disk.finish_write(write.block_hash, exc is None)
            if exc is None:
                self.disk_stats.store_bytes += disk.file_bytes
            elif isinstance(exc, OSError) and disk_io.is_disk_full(exc):
                self._fail("disk_full")
                disk.warn("full", "disk full, blocks are not stored (%s)", exc)
            else:
                self._fail("io_error")
                disk.warn("write", "a block could not be written (%s)", exc)
            del self._writing[write.block_hash]
            self.pool.unpin(write.slot)
            self._release(write.slot)
        self._writes = remaining

    def _advance(self, load: _Load) -> None:
        if not load.issued:
            if any(p.read is not None and not p.read.done() for p in load.parts):
                return
            num_intact = 0
            for part in load.parts:
                status = part.read.result() if part.read is not None else ReadStatus.OK
                if status is not ReadStatus.OK:
                    self._drop_disk_block(part.block_hash, status)
                    break
                num_intact += 1
            self._issue(load, num_intact)
        if load.event is not None and not load.event.query():
            return
        self._land(load)

    def _issue(self, load: _Load, num_intact: int) -> None:
        load.issued = True
        load.num_intact = num_intact
        if num_intact:
            parts = load.parts[:num_intact]
            load.event = self.mover.load([p.slot for p in parts], [p.block_id for p in parts])
        if load.event is not None:
            # Finished for the scheduler now; the next step waits for the copies on the GPU.
            del self._loads[load.load_id]
            self._copying[load.load_id] = load
            self._unwaited.append(load.event)
            self._finished.append((load.load_id, num_intact))

    def _land(self, load: _Load) -> None:
        """The load's copies have run (or it had none): release its host slots; report it to
        the scheduler unless `_issue` did already."""
        reported = self._copying.pop(load.load_id, None) is not None
        if not reported:
            del self._loads[load.load_id]
        elapsed = time.perf_counter() - load.started
        from_disk = False
        for i, part in enumerate(load.parts):
            self.pool.unpin(part.slot)
            if part.read is None:
                if i < load.num_intact:
                    if part.writing:
                        self.disk_stats.load_bytes += self.block_bytes
                        from_disk = True
                    else:
                        self.cpu_stats.load_bytes += self.block_bytes
                self._release(part.slot)
                continue
            assert self.disk is not None
            self.disk.unpin(part.block_hash)
            from_disk = True
            if i < load.num_intact:
                self.disk_stats.load_bytes += self.block_bytes
                self._promote(part.block_hash, part.slot)
            else:
                self._release(part.slot)
        if load.num_intact:
            stats = self.disk_stats if from_disk else self.cpu_stats
            stats.load_count += 1
            stats.load_seconds += elapsed
            stats.load_buckets[bisect.bisect_left(KV_TIER_LOAD_BUCKETS, elapsed)] += 1
        if not reported:
            self._finished.append((load.load_id, load.num_intact))

    def _promote(self, block_hash: bytes, slot: int) -> None:
        """A block read from disk joins the CPU tier (or its bounce slot is freed)."""
        if not self.cpu_blocks or block_hash in self._cpu:
            self._release(slot)
            return
        while len(self._cpu) >= self.cpu_blocks:
            if not self._evict_cpu():
                self._release(slot)
                return
        self._cpu[block_hash] = slot
        self._slot_hash[slot] = block_hash

    def _drop_disk_block(self, block_hash: bytes, status: ReadStatus) -> None:
        disk = self.disk
        assert disk is not None
        disk.forget(block_hash)
        self._fail(status.value)
        disk.warn(
            status.value,
            "%s file %s is a miss (%s): the block is computed instead",
            status.value,
            disk.path(block_hash),
            "removed" if status is not ReadStatus.IO_ERROR else "kept",
        )
        if status is not ReadStatus.IO_ERROR:
            # Now, on this thread: a write of the same block queued later must not lose its
            # file to this removal.
            disk_io.remove(disk.path(block_hash))

    def _fail(self, reason: str) -> None:
        failures = self.disk_stats.failures
        failures[reason] = failures.get(reason, 0) + 1

    # ---- state --------------------------------------------------------------------------------

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._loads) + len(self._copying)

    @property
    def num_queued_stores(self) -> int:
        return len(self._queued)

    @property
    def num_cpu_blocks(self) -> int:
        return len(self._cpu)

    def is_idle(self) -> bool:
        """No load, store or write under way and no host slot in use beyond the CPU tier's."""
        return (
            not self._loads
            and not self._copying
            and not self._writes
            and self.pool.num_pinned == 0
            and self.pool.num_free + len(self._cpu) == self.pool.num_slots
        )

    def stats(self) -> list[KvTierStats]:
        out: list[KvTierStats] = []
        if self.cpu_blocks:
            self.cpu_stats.used_bytes = len(self._cpu) * self.block_bytes
            out.append(_copy(self.cpu_stats))
        if self.disk is not None:
            self.disk_stats.used_bytes = self.disk.used_bytes
            out.append(_copy(self.disk_stats))
        return out

    def cpu_hashes(self) -> list[bytes]:
        """The CPU tier's blocks, least recently used first."""
        return list(self._cpu)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Copy every queued block now and wait until the copies, loads and disk writes under
        way are done (or `timeout_s` passed)."""
        deadline = time.monotonic() + timeout_s
        if self._queued:
            self._flush_now()
        if self.mover.is_async:
            torch.cuda.synchronize(self.mover.image.device)
        while (self._loads or self._copying or self._writes) and time.monotonic() < deadline:
            self.wait(0.01)
            self.poll()

    def close(self, persist: bool = True, deadline_s: float = 10.0) -> None:
        """Finish what is under way; with `persist`, write the CPU tier's blocks that are not
        on disk yet (until `deadline_s`), so a restart on the same disk finds them. Loads that
        never landed are left to the scheduler, which is going away too."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + deadline_s
        self.drain(deadline_s)
        if persist and self.disk is not None:
            for block_hash, slot in list(self._cpu.items()):
                if block_hash in self.disk or block_hash in self._writing:
                    continue
                while len(self._writes) >= MAX_DISK_WRITES and time.monotonic() < deadline:
                    self.wait(0.05)
                    self._reap_writes()
                if time.monotonic() >= deadline:
                    logger.warning(
                        "KV offload: shutdown deadline reached before the CPU tier was on disk"
                    )
                    break
                self._write_to_disk(block_hash, slot)
            self.drain(max(0.0, deadline - time.monotonic()))
        for executor in (self._readers, self._writers):
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
        if self._writes:
            self._reap_writes()
        self.pool.close()


def _read_job(
    path: Path,
    identity: bytes,
    block_hash: bytes,
    out: np.ndarray,
    ready: torch.cuda.Event | None,
) -> ReadStatus:
    """Worker thread: wait until no earlier copy from the GPU can still land in the slot
    (it held another block before), then read the file into it."""
    if ready is not None:
        ready.synchronize()
    return disk_io.read_block(path, identity, block_hash, out)


def _write_job(
    path: Path,
    identity: bytes,
    block_hash: bytes,
    payload: np.ndarray,
    ready: torch.cuda.Event | None,
    victims: list[Path],
) -> None:
    """Worker thread: wait for the image to be in host memory, make room, write the file."""
    if ready is not None:
        ready.synchronize()
    for victim in victims:
        disk_io.remove(victim)
    header = disk_io.encode_header(identity, block_hash, payload)
    disk_io.write_block(path, header, payload)


def _copy(stats: KvTierStats) -> KvTierStats:
    return KvTierStats(
        tier=stats.tier,
        capacity_bytes=stats.capacity_bytes,
        used_bytes=stats.used_bytes,
        hits=stats.hits,
        misses=stats.misses,
        load_bytes=stats.load_bytes,
        store_bytes=stats.store_bytes,
        dropped_stores=stats.dropped_stores,
        load_seconds=stats.load_seconds,
        load_count=stats.load_count,
        load_buckets=list(stats.load_buckets),
        failures=dict(stats.failures),
    )
