"""KV offload through the real engine core on the CPU (runner V1, a tiny random model): the
eviction order across the tiers, a restart served from disk, damaged and foreign files and a
full disk as misses, and 200 requests aborted at random while they load."""

from __future__ import annotations

import errno
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.core.block_manager import hash_block_tokens
from davit_engine.core.request import RequestStatus
from davit_engine.engine_core import EngineCore
from davit_engine.offload import disk as disk_io
from davit_engine.offload.disk import ReadStatus
from davit_engine.offload.tiers import KvTiers
from davit_engine.types import EngineRequest, SamplingParams

BS = 16
TINY_BLOCK_BYTES = 2 * 2 * BS * 2 * 32 * 4  # layers x K/V x tokens x heads x dim x fp32


def make_core(
    gpu_blocks: int = 16, cpu_blocks: int = 0, disk: Path | None = None, **extra: Any
) -> EngineCore:
    flags: dict[str, Any] = {}
    if cpu_blocks:
        flags["kv_offloading_size"] = cpu_blocks * TINY_BLOCK_BYTES / 2**30
    if disk is not None:
        flags["kv_offload_disk_path"] = str(disk)
        flags["kv_offload_disk_bytes"] = 10_000 * (TINY_BLOCK_BYTES + disk_io.HEADER_BYTES)
    config = EngineConfig(
        model="random:qwen3-tiny",
        device="cpu",
        dtype="float32",
        num_gpu_blocks=gpu_blocks,
        max_num_seqs=8,
        **flags,
        **extra,
    )
    return EngineCore(config)


def tiers_of(core: EngineCore) -> KvTiers:
    assert core.tiers is not None
    return core.tiers


def run(core: EngineCore, prompt: list[int], rid: str, max_tokens: int = 4) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(EngineRequest(rid, prompt, params))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens += delta.new_token_ids
    return tokens


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(length)]


def chain(tokens: list[int], num_blocks: int) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(num_blocks):
        hashes.append(
            hash_block_tokens(hashes[-1] if hashes else None, tokens[i * BS : (i + 1) * BS])
        )
    return hashes


@pytest.fixture(scope="module")
def reference() -> EngineCore:
    """The same model without tiers and with room for everything: outputs to compare with."""
    return make_core(gpu_blocks=64)


def test_blocks_cascade_gpu_cpu_disk_in_lru_order(tmp_path: Path) -> None:
    core = make_core(gpu_blocks=8, cpu_blocks=4, disk=tmp_path)
    tiers = tiers_of(core)
    prompts = [prompt_of(i, 2 * BS + 1) for i in range(4)]
    for i, prompt in enumerate(prompts):
        run(core, prompt, f"p{i}", max_tokens=1)
        tiers.drain()
    blocks = [chain(p, 2) for p in prompts]
    # Write-through: every full block went to the CPU tier; it keeps the 4 most recent, and
    # each block it evicted went on to disk.
    assert tiers.cpu_hashes() == blocks[2] + blocks[3]
    assert tiers.disk is not None
    # (Disk writes finish in any order on the worker threads: compared as sets.)
    assert set(tiers.disk.hashes()) == {*blocks[0], *blocks[1]}
    # A prompt of the GPU cache's whole size pushes everything down one tier.
    filler = prompt_of(9, 7 * BS + 1)
    run(core, filler, "filler", max_tokens=1)
    tiers.drain()
    filled = chain(filler, 7)
    assert tiers.cpu_hashes() == filled[3:]
    assert set(tiers.disk.hashes()) == {*blocks[0], *blocks[1], *blocks[2], *blocks[3], *filled[:3]}
    assert core.scheduler.block_manager.num_cached_blocks == 7  # the filler's blocks alone
    # Blocks read back from disk join the CPU tier as its most recent ones; the CPU tier's
    # least recent ones are on disk already, so they just leave it.
    run(core, [*prompts[0], 7], "again", max_tokens=1)
    tiers.drain()
    assert tiers.cpu_hashes() == [*filled[5:], *blocks[0]]
    assert tiers.stats()[1].load_bytes == 2 * TINY_BLOCK_BYTES
    core.shutdown()
    assert tiers.is_idle()


@pytest.mark.parametrize("tier", ["cpu", "disk", "both"])
def test_served_from_a_tier_equals_the_reference(
    tmp_path: Path, tier: str, reference: EngineCore
) -> None:
    core = make_core(
        gpu_blocks=12,
        cpu_blocks=64 if tier in ("cpu", "both") else 0,
        disk=tmp_path if tier in ("disk", "both") else None,
    )
    prefix = prompt_of(1, 6 * BS)
    run(core, [*prefix, 3], "first")
    run(core, prompt_of(2, 180), "evicts")  # 12 blocks: the prefix leaves the GPU cache
    computed = core.runner.num_computed_tokens_total  # type: ignore[attr-defined]
    question = [*prefix, 9, 8, 7]
    tokens = run(core, question, "back", max_tokens=8)
    assert tokens == run(reference, question, f"ref-{tier}", max_tokens=8)
    # Only the tokens after the prefix went through the model (and 7 decode steps).
    assert core.runner.num_computed_tokens_total - computed == 3 + 7  # type: ignore[attr-defined]
    loaded = {s.tier: s.load_bytes for s in tiers_of(core).stats()}
    source = "disk" if tier == "disk" else "cpu"
    assert loaded[source] == 6 * TINY_BLOCK_BYTES
    core.shutdown()


def test_a_restarted_engine_serves_a_known_prefix_from_disk(
    tmp_path: Path, reference: EngineCore
) -> None:
    prefix = prompt_of(3, 8 * BS + 5)
    first = make_core(cpu_blocks=32, disk=tmp_path)
    run(first, [*prefix, 1], "before")
    first.shutdown()  # the CPU tier's blocks go to disk
    second = make_core(cpu_blocks=32, disk=tmp_path)
    assert second.model_info.kv_offload is not None
    assert second.model_info.kv_offload["disk_blocks_found"] == 8
    question = [*prefix, 2, 4]
    tokens = second.runner.num_computed_tokens_total  # type: ignore[attr-defined]
    assert run(second, question, "after", max_tokens=6) == run(
        reference, question, "ref-restart", max_tokens=6
    )
    # 8 blocks came from disk: 5 + 2 prompt tokens and 5 decode steps were computed.
    assert second.runner.num_computed_tokens_total - tokens == 7 + 5  # type: ignore[attr-defined]
    second.shutdown()


def foreign_copy(tmp_path: Path, prefix: list[int]) -> Path:
    """A block file of the same tokens written by another model (another seed)."""
    other_root = tmp_path / "other"
    other = make_core(disk=other_root, seed=1)
    run(other, [*prefix, 1], "other")
    other.shutdown()
    files = sorted(other_root.rglob("*.kvb"))
    assert files
    return files[0]


@pytest.mark.parametrize(
    ("damage", "failure"),
    [
        ("corrupt", "corrupt"),
        ("truncated", "truncated"),
        ("foreign", "foreign"),  # another model's file of the same tokens
        ("renamed", "foreign"),  # another block's valid file under this block's name
        ("truncated_before_start", None),  # the startup scan drops it: a plain miss
    ],
)
def test_damaged_or_foreign_files_are_misses(
    tmp_path: Path, damage: str, failure: str | None, reference: EngineCore
) -> None:
    root = tmp_path / "kv"
    prefix = prompt_of(4, 5 * BS)
    first = make_core(disk=root)
    run(first, [*prefix, 1], "write")
    first.shutdown()
    hashes = chain(prefix, 5)
    folder = next(p for p in root.iterdir() if p.is_dir())
    victim = folder / hashes[2].hex()[:2] / (hashes[2].hex() + disk_io.SUFFIX)
    foreign = foreign_copy(tmp_path, prefix) if damage == "foreign" else None
    raw = bytearray(victim.read_bytes())
    if damage == "truncated_before_start":
        victim.write_bytes(bytes(raw[: len(raw) // 2]))
    second = make_core(disk=root)
    if damage == "corrupt":
        raw[disk_io.HEADER_BYTES + 10] ^= 0x40
        victim.write_bytes(bytes(raw))
    elif damage == "truncated":
        victim.write_bytes(bytes(raw[: len(raw) // 2]))
    elif foreign is not None:
        shutil.copyfile(foreign, victim)
    elif damage == "renamed":
        shutil.copyfile(folder / hashes[3].hex()[:2] / (hashes[3].hex() + disk_io.SUFFIX), victim)
    tiers = tiers_of(second)
    question = [*prefix, 5, 6]
    before = second.runner.num_computed_tokens_total  # type: ignore[attr-defined]
    assert run(second, question, "read", max_tokens=5) == run(
        reference, question, f"ref-{damage}", max_tokens=5
    )
    # Blocks 0 and 1 loaded; 2 was refused, so 2..4, the 2 new tokens and 4 decodes computed.
    assert second.runner.num_computed_tokens_total - before == 3 * BS + 2 + 4  # type: ignore[attr-defined]
    assert tiers.stats()[0].failures == ({failure: 1} if failure else {})
    tiers.drain()
    second.shutdown()
    # Removed, and written again from the block the engine computed instead.
    image = np.zeros(TINY_BLOCK_BYTES, dtype=np.uint8)
    assert disk_io.read_block(victim, tiers.disk.digest, hashes[2], image) is ReadStatus.OK  # type: ignore[union-attr]


def test_a_full_disk_means_misses_not_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: EngineCore
) -> None:
    def no_space(fd: int, data: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_io, "_write_all", no_space)
    core = make_core(gpu_blocks=12, disk=tmp_path)
    prefix = prompt_of(6, 6 * BS)
    run(core, [*prefix, 1], "a")
    run(core, prompt_of(7, 180), "evict")
    question = [*prefix, 3]
    assert run(core, question, "b") == run(reference, question, "ref-full")
    tiers = tiers_of(core)
    tiers.drain()
    stats = tiers.stats()[0]
    assert stats.failures.get("disk_full", 0) > 0 and stats.load_bytes == 0
    assert not list(tmp_path.rglob("*.kvb")) and not list(tmp_path.rglob("*.tmp"))
    core.shutdown()
    assert tiers.is_idle()


def test_200_requests_aborted_at_random_while_loading_leave_everything_free(
    tmp_path: Path,
) -> None:
    rng = random.Random(11)
    core = make_core(gpu_blocks=24, cpu_blocks=12, disk=tmp_path)
    tiers = tiers_of(core)
    prefixes = [prompt_of(100 + i, rng.randrange(2, 6) * BS) for i in range(12)]
    pending = [
        EngineRequest(
            f"r{i}",
            [*prefixes[rng.randrange(12)], rng.randrange(1, 500)],
            SamplingParams(max_tokens=rng.randrange(1, 6), temperature=0.0, ignore_eos=True),
        )
        for i in range(200)
    ]
    live: set[str] = set()
    aborted_loading = 0
    while pending or core.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                req = pending.pop(0)
                core.add_request(req)
                live.add(req.request_id)
        for request_id in list(live):
            req_state = core.scheduler.get_request(request_id)
            if req_state is None:
                live.discard(request_id)
                continue
            loading = req_state.status is RequestStatus.LOADING
            if rng.random() < (0.5 if loading else 0.03):
                aborted_loading += loading
                core.abort_requests([request_id])
                live.discard(request_id)
        for delta in core.step():
            if delta.finished:
                live.discard(delta.request_id)
        core.scheduler.check_invariants()
    assert aborted_loading >= 5
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_loading == 0
    assert sum(s.load_bytes for s in stats.kv_offload) > 0
    tiers.drain()
    assert tiers.is_idle()  # no load, write or pinned host slot left
    core.shutdown()
    assert tiers.pool.num_pinned == 0


def test_busy_staging_buffers_defer_stores_until_one_is_due() -> None:
    core = make_core(gpu_blocks=16, cpu_blocks=32)
    tiers = tiers_of(core)
    tiers.mover.can_store = lambda: False  # type: ignore[method-assign]  # every buffer busy
    run(core, prompt_of(20, 3 * BS + 1), "a", max_tokens=1)
    for _ in range(10):
        tiers.flush()
    assert tiers.num_queued_stores == 3 and tiers.num_cpu_blocks == 0
    tiers.block_reused(next(iter(tiers._queued)))  # about to hold other tokens: due now
    tiers.flush()
    assert tiers.num_queued_stores == 0 and tiers.num_cpu_blocks == 3
    core.shutdown()


def test_writes_behind_a_slow_disk_leave_host_slots_for_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: EngineCore
) -> None:
    """Without a CPU tier every host slot is a bounce buffer. Writes that back up behind a
    slow disk hold theirs until the file is written; they may take half of the slots, never
    the rest, so a returning prefix is still read from disk rather than computed again, and
    without waiting for any write."""
    core = make_core(gpu_blocks=12, disk=tmp_path)
    tiers = tiers_of(core)
    prefix = prompt_of(30, 6 * BS)
    run(core, [*prefix, 1], "first")
    tiers.drain()
    disk = tiers.disk
    assert disk is not None and all(h in disk for h in chain(prefix, 6))
    stuck = threading.Event()
    write_block = disk_io.write_block
    written: list[Path] = []

    def slow_write(path: Path, header: bytes, payload: np.ndarray) -> None:
        stuck.wait(60)
        write_block(path, header, payload)
        written.append(path)

    monkeypatch.setattr(disk_io, "write_block", slow_write)
    for i in range(12):  # 132 new full blocks to store, far more than the host slots
        run(core, prompt_of(40 + i, 11 * BS + 1), f"filler{i}", max_tokens=1)
    pool = tiers.pool
    assert pool.num_slots - pool.num_free == tiers.read_reserve  # writes took their half
    loaded_before = tiers.stats()[0].load_bytes
    question = [*prefix, 5, 6]
    assert run(core, question, "back", max_tokens=6) == run(
        reference, question, "ref-slow", max_tokens=6
    )
    assert tiers.stats()[0].load_bytes - loaded_before == 6 * TINY_BLOCK_BYTES
    # The reads did not wait for any of the stuck writes (their own threads).
    assert written == []
    stuck.set()
    tiers.drain()
    core.shutdown()
    assert tiers.is_idle()


class _Event:
    """A CUDA event's interface over a flag the test sets."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _Stream:
    def __init__(self) -> None:
        self.waited: list[_Event] = []

    def wait_event(self, event: _Event) -> None:
        self.waited.append(event)


def test_a_queued_load_lets_its_request_join_the_next_step(
    monkeypatch: pytest.MonkeyPatch, reference: EngineCore
) -> None:
    """With asynchronous copies a load is finished for the scheduler once its copies are queued:
    the request is scheduled in the next step, whose stream waits for the copies first, and its
    host slots stay pinned until the copies have run."""
    core = make_core(gpu_blocks=12, cpu_blocks=64)
    tiers = tiers_of(core)
    prefix = prompt_of(50, 6 * BS)
    run(core, [*prefix, 3], "first")
    run(core, prompt_of(51, 180), "evicts")
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    events: list[_Event] = []
    copy_in = tiers.mover.load

    def queued_load(slots: list[int], block_ids: list[int]) -> _Event:
        copy_in(slots, block_ids)  # the CPU cache copies at once; the event says "not yet"
        events.append(_Event())
        return events[-1]

    monkeypatch.setattr(tiers.mover, "load", queued_load)
    monkeypatch.setattr(tiers.mover, "is_async", True)
    question = [*prefix, 9, 8]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    core.add_request(EngineRequest("back", question, params))
    tokens: list[int] = []
    steps = 0
    while core.has_unfinished_requests():
        tokens += [t for d in core.step() for t in d.new_token_ids]
        steps += 1
        if steps == 1:
            # The load was queued and reported in this step, its copies "still running".
            assert len(events) == 1 and not events[0].done
            assert tiers.pool.num_pinned == 6 and tiers.num_loads_in_flight == 1
        if steps == 2:
            assert stream.waited == events  # the step waited for the copies on the stream
            assert tokens, "the request was not scheduled in the step after its load"
            assert tiers.pool.num_pinned == 6  # copies not done: the slots stay pinned
            events[0].done = True
    assert tokens == run(reference, question, "ref-queued", max_tokens=5)
    tiers.poll()
    assert tiers.pool.num_pinned == 0 and tiers.num_loads_in_flight == 0
    assert tiers.stats()[0].load_bytes == 6 * TINY_BLOCK_BYTES
    monkeypatch.setattr(tiers.mover, "is_async", False)  # no device to synchronize at shutdown
    core.shutdown()


FP8_BLOCK_BYTES = TINY_BLOCK_BYTES // 4  # one byte per element instead of four


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_an_fp8_cache_goes_through_the_tiers(tmp_path: Path, tier: str) -> None:
    """An FP8 KV cache's blocks (keys rotated, values key-minor) offloaded and loaded back:
    the tokens of an FP8 engine that kept them, one byte per element moved."""
    reference = make_core(gpu_blocks=64, kv_cache_dtype="fp8")
    core = make_core(
        gpu_blocks=12,
        cpu_blocks=64 if tier == "cpu" else 0,
        disk=tmp_path if tier == "disk" else None,
        kv_cache_dtype="fp8",
    )
    prefix = prompt_of(1, 6 * BS)
    run(core, [*prefix, 3], "first")
    run(core, prompt_of(2, 180), "evicts")  # 12 blocks: the prefix leaves the GPU cache
    computed = core.runner.num_computed_tokens_total  # type: ignore[attr-defined]
    question = [*prefix, 9, 8, 7]
    assert run(core, question, "back", max_tokens=8) == run(reference, question, "ref", 8)
    assert core.runner.num_computed_tokens_total - computed == 3 + 7  # type: ignore[attr-defined]
    loaded = {s.tier: s.load_bytes for s in tiers_of(core).stats()}
    assert loaded[tier] == 6 * FP8_BLOCK_BYTES
    core.shutdown()
    reference.shutdown()


def test_a_disk_tier_serves_only_engines_of_its_kv_dtype(tmp_path: Path) -> None:
    """Blocks written by an engine with a float32 cache are not read into an FP8 cache (other
    bytes per block: a miss, the prefix is computed again), and still serve a float32
    engine afterwards."""
    core = make_core(gpu_blocks=12, disk=tmp_path)
    prefix = prompt_of(1, 6 * BS)
    run(core, [*prefix, 3], "first")
    tiers_of(core).drain()
    core.shutdown()
    question = [*prefix, 9, 8, 7]
    for dtype, loaded_bytes in (("fp8", 0), ("auto", 6 * TINY_BLOCK_BYTES)):
        reference = make_core(gpu_blocks=64, kv_cache_dtype=dtype)
        core = make_core(gpu_blocks=12, disk=tmp_path, kv_cache_dtype=dtype)
        assert run(core, question, "back", 8) == run(reference, question, "ref", 8), dtype
        loaded = {s.tier: s.load_bytes for s in tiers_of(core).stats()}
        assert loaded["disk"] == loaded_bytes, dtype
        core.shutdown()
        reference.shutdown()
