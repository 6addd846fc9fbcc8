"""Copies between the KV cache and host slots: asynchronous on CUDA, immediate on the CPU.

CUDA. A store gathers the blocks into a GPU staging buffer on the *current* stream (the one the
runner's steps run on), so the gather reads each block after the steps that wrote it and before
any later step that reuses it: no host wait, and no block is overwritten before its copy is
taken. The device-to-host copies of the staged images then run on a store stream. A load copies
images host-to-device into a load staging buffer and scatters them into their blocks on a load
stream, after everything launched on the current stream so far (a request that finished in the
step in flight may still write its last block, which a load may have been given). Events say
when each is done; the engine loop only polls them.

The staging buffers live on the GPU beside the KV cache and are taken out of its bytes
(`staging_bytes`).
"""

from __future__ import annotations

import torch

from davit_engine.offload.block_image import BlockImage
from davit_engine.offload.host_pool import HostPool

# Staging buffers for stores, used in turn (a fourth one serves loads).
STORE_BUFFERS = 3
MAX_CHUNK_BLOCKS = 32


def chunk_blocks(num_gpu_blocks: int) -> int:
    """Blocks one staging buffer holds: 32, fewer for a small cache (about 1/64 of it), so
    the staging takes at most about 6% of a small cache and 128 blocks of a large one."""
    return max(4, min(MAX_CHUNK_BLOCKS, num_gpu_blocks // 64))


def staging_blocks(chunk: int) -> int:
    """GPU blocks' worth of memory the staging buffers of `chunk` blocks take."""
    return (STORE_BUFFERS + 1) * chunk


class Mover:
    """Immediate copies (a CPU KV cache): everything is done when the call returns."""

    is_async = False

    def __init__(self, image: BlockImage, pool: HostPool, chunk: int = MAX_CHUNK_BLOCKS) -> None:
        self.image = image
        self.pool = pool
        self.chunk = chunk  # blocks copied per batch
        self.num_store_stalls = 0

    @property
    def staging_bytes(self) -> int:
        return 0

    def can_store(self) -> bool:
        """Whether a batch of `chunk` blocks can be stored without the host waiting."""
        return True

    def store(self, block_ids: list[int], slots: list[int]) -> torch.cuda.Event | None:
        """Copy blocks into host slots; returns the event that marks them copied (None: done)."""
        for block_id, slot in zip(block_ids, slots, strict=True):
            self.image.copy_out(block_id, self.pool.image(slot))
        return None

    def load(self, slots: list[int], block_ids: list[int]) -> torch.cuda.Event | None:
        """Copy host slots into blocks; returns the event that marks them in place."""
        for slot, block_id in zip(slots, block_ids, strict=True):
            self.image.copy_in(block_id, self.pool.image(slot))
        return None


class CudaMover(Mover):
    is_async = True

    def __init__(self, image: BlockImage, pool: HostPool, chunk: int) -> None:
        super().__init__(image, pool, chunk)
        device = image.device
        self.store_stream = torch.cuda.Stream(device)
        self.load_stream = torch.cuda.Stream(device)
        parts = image.part_bytes
        self._store_staging = [
            [torch.empty(chunk, n, dtype=torch.uint8, device=device) for n in parts]
            for _ in range(STORE_BUFFERS)
        ]
        self._store_done: list[torch.cuda.Event | None] = [None] * STORE_BUFFERS
        self._store_turn = 0
        self._load_staging = [
            torch.empty(chunk, n, dtype=torch.uint8, device=device) for n in parts
        ]
        self._offsets = image.part_offsets()

    @property
    def staging_bytes(self) -> int:
        return staging_blocks(self.chunk) * self.image.block_bytes

    def can_store(self) -> bool:
        previous = self._store_done[self._store_turn]
        return previous is None or previous.query()

    def store(self, block_ids: list[int], slots: list[int]) -> torch.cuda.Event | None:
        done: torch.cuda.Event | None = None
        c = self.chunk
        for start in range(0, len(block_ids), c):
            done = self._store_chunk(block_ids[start : start + c], slots[start : start + c])
        return done

    def _store_chunk(self, block_ids: list[int], slots: list[int]) -> torch.cuda.Event:
        turn = self._store_turn
        self._store_turn = (turn + 1) % STORE_BUFFERS
        previous = self._store_done[turn]
        if previous is not None and not previous.query():
            # Every buffer still drains to the host: wait for the oldest (rare; counted).
            self.num_store_stalls += 1
            previous.synchronize()
        staging = self._store_staging[turn]
        device = self.image.device
        # A pinned index copied without a host wait; the pinned allocator keeps its memory
        # until the copy has run.
        index = (
            torch.tensor(block_ids, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        )
        self.image.gather(index, staging)  # current stream: ordered with the steps
        gathered = torch.cuda.Event()
        gathered.record()
        stream = self.store_stream
        stream.wait_event(gathered)
        with torch.cuda.stream(stream):
            for i, slot in enumerate(slots):
                host = self.pool.image(slot)
                for (start, end), stage in zip(self._offsets, staging, strict=True):
                    host[start:end].copy_(stage[i], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._store_done[turn] = done
        return done

    def load(self, slots: list[int], block_ids: list[int]) -> torch.cuda.Event | None:
        stream = self.load_stream
        launched = torch.cuda.Event()
        launched.record()  # everything on the current stream so far, steps in flight included
        stream.wait_event(launched)
        device = self.image.device
        with torch.cuda.stream(stream):
            for slot in set(slots):
                pending = self.pool.ready[slot]
                if pending is not None:
                    stream.wait_event(pending)  # a store into this slot still in flight
            c = self.chunk
            for start in range(0, len(slots), c):
                chunk_slots = slots[start : start + c]
                chunk_ids = block_ids[start : start + c]
                for i, slot in enumerate(chunk_slots):
                    host = self.pool.image(slot)
                    for (lo, hi), stage in zip(self._offsets, self._load_staging, strict=True):
                        stage[i].copy_(host[lo:hi], non_blocking=True)
                index = (
                    torch.tensor(chunk_ids, dtype=torch.int64)
                    .pin_memory()
                    .to(device, non_blocking=True)
                )
                self.image.scatter(index, self._load_staging)
            done = torch.cuda.Event()
            done.record(stream)
        return done
