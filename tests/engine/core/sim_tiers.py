"""A lower KV tier for the simulated runner: copies of SimRunner's per-slot prefix digests.

It keeps the `LowerTiers` contract the way the real tiers must: a queued store is copied from
the runner's cache only when `flush()` runs (the offloading runner wrapper calls it before each
step), a load writes the stored digests into the GPU blocks only when it lands some polls
later, and hashes marked damaged end a load's intact prefix. A copy taken from a block that
was already reused, or a load that writes the wrong blocks, changes digests that SimRunner
checks against the true prefix, so such bugs fail the run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from davit_engine.core.batch import RunnerOutput, SchedulerOutput
from davit_engine.core.kv_tiers import LowerTiers
from tests.engine.core.sim import SimRunner


@dataclass
class _SimLoad:
    load_id: int
    hashes: list[bytes]
    block_ids: list[int]
    polls_left: int


@dataclass
class SimTiers(LowerTiers):
    runner: SimRunner
    capacity: int = 1_000_000  # blocks; least recently used dropped beyond it
    load_polls: int = 2  # finished_loads() calls before a load lands
    damaged: set[bytes] = field(default_factory=set)  # blocks whose copy reads back broken
    refuse_loads: bool = False  # load() starts nothing (a tier that lost everything)
    blocks: OrderedDict[bytes, list[int | None]] = field(default_factory=OrderedDict)
    queued: dict[int, bytes] = field(default_factory=dict)  # GPU block id -> hash
    loads: list[_SimLoad] = field(default_factory=list)
    num_flushes: int = 0
    num_reuse_flushes: int = 0
    num_stored: int = 0
    num_loaded: int = 0
    must_flush: bool = False

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def store(self, block_hash: bytes, block_id: int) -> None:
        self.queued[block_id] = block_hash

    def block_reused(self, block_id: int) -> None:
        if block_id in self.queued:
            self.must_flush = True

    def flush(self) -> None:
        """Copy every queued block now (before the next step runs)."""
        self.num_flushes += 1
        self.num_reuse_flushes += self.must_flush
        self.must_flush = False
        for block_id, block_hash in self.queued.items():
            for load in self.loads:
                assert block_id not in load.block_ids, "stored a block that is being loaded"
            self.blocks[block_hash] = list(self.runner.kv[block_id])
            self.blocks.move_to_end(block_hash)
            self.num_stored += 1
        self.queued.clear()
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def load(self, load_id: int, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        if self.refuse_loads:
            return 0
        if any(b in self.queued for b in block_ids):
            self.flush()  # the old contents' copies first: the load overwrites them
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.blocks:
            n += 1
        if n:
            load = _SimLoad(load_id, list(block_hashes[:n]), list(block_ids[:n]), self.load_polls)
            self.loads.append(load)
        return n

    def finished_loads(self) -> list[tuple[int, int]]:
        done: list[tuple[int, int]] = []
        for load in list(self.loads):
            load.polls_left -= 1
            if load.polls_left > 0:
                continue
            self.loads.remove(load)
            intact = 0
            for block_hash, block_id in zip(load.hashes, load.block_ids, strict=True):
                if block_hash in self.damaged or block_hash not in self.blocks:
                    break
                self.runner.kv[block_id] = list(self.blocks[block_hash])
                self.blocks.move_to_end(block_hash)
                intact += 1
            self.num_loaded += intact
            done.append((load.load_id, intact))
        return done

    def wait(self, timeout_s: float) -> None:
        pass

    def discard_stores(self) -> None:
        self.queued.clear()


class FlushingRunner:
    """The simulated runner behind the same wrapper rule as the real one: the tiers' queued
    copies are taken before every step."""

    def __init__(self, runner: SimRunner, tiers: SimTiers) -> None:
        self.runner = runner
        self.tiers = tiers
        self.name = runner.name

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.tiers.flush()
        return self.runner.execute(out)
