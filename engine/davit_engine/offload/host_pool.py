"""Host memory for KV block images: the CPU tier's blocks and the disk tier's bounce buffers.

One tensor of `num_slots` block images. With a CUDA cache the memory is page-locked (registered
with the driver after a plain allocation: torch's pinned allocator rounds a request up to a
power of two, which would take up to twice the configured size), so copies to and from the GPU
run asynchronously on the copy engines; with a CPU cache it is ordinary memory.

A slot is free, holds a CPU-tier block, or is a bounce buffer of an operation under way.
`pins` counts the copies and file operations that still read or write a slot: a pinned slot is
never handed out again, so nothing overwrites an image another operation still uses.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

logger = logging.getLogger(__name__)


class HostPool:
    def __init__(self, num_slots: int, block_bytes: int, pin: bool) -> None:
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.images = torch.empty(num_slots, block_bytes, dtype=torch.uint8)  # [slots, bytes]
        self.is_pinned = False
        if pin and num_slots:
            self.is_pinned = _register(self.images)
        self.pins = [0] * num_slots
        self._free: deque[int] = deque(range(num_slots))
        # The last copy from the GPU into each slot (CUDA event), waited on by whoever reads
        # the slot or writes it from the host next.
        self.ready: list[torch.cuda.Event | None] = [None] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self.pins if p)

    def take(self) -> int | None:
        return self._free.popleft() if self._free else None

    def give_back(self, slot: int) -> None:
        """Free a slot. Its `ready` event stays: a copy into it may still be in flight, and
        whoever writes the slot next from the host waits for it."""
        assert self.pins[slot] == 0, f"slot {slot} freed while in use"
        self._free.append(slot)

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        assert self.pins[slot] > 0
        self.pins[slot] -= 1

    def image(self, slot: int) -> torch.Tensor:
        return self.images[slot]

    def array(self, slot: int) -> np.ndarray:
        """The slot as a numpy array sharing its memory (for file I/O on worker threads)."""
        return self.images[slot].numpy()

    def close(self) -> None:
        if self.is_pinned:
            torch.cuda.cudart().cudaHostUnregister(self.images.data_ptr())
            self.is_pinned = False


def _register(images: torch.Tensor) -> bool:
    """Page-lock `images` for asynchronous copies; False (with a warning) when the driver
    refuses, e.g. over the locked-memory limit: copies then still work, synchronously."""
    nbytes = images.numel()
    result = torch.cuda.cudart().cudaHostRegister(images.data_ptr(), nbytes, 0)
    code = int(result[0] if isinstance(result, tuple) else result)
    if code != 0:
        logger.warning(
            "KV offload: could not page-lock %.2f GiB of host memory (CUDA error %d); copies "
            "between the GPU and the CPU tier will be slower",
            nbytes / 2**30,
            code,
        )
        return False
    return True
