"""Host memory for KV block images: the CPU tier's blocks and the disk tier's bounce buffers.

`num_slots` block images. With a CUDA cache the memory is page-locked, so copies to and from
the GPU run asynchronously on the copy engines; with a CPU cache it is ordinary memory. torch's
pinned allocator rounds every request up to a power of two, which would take up to twice the
configured bytes: the slots are carved from allocations of exact powers of two instead (the
binary digits of the total), wasting less than a block per allocation.

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
        self.is_pinned = bool(pin and num_slots)
        self._rows: list[torch.Tensor] = []  # one [block_bytes] uint8 image per slot
        if self.is_pinned:
            try:
                self._rows = _pinned_rows(num_slots, block_bytes)
            except RuntimeError as exc:
                logger.warning("KV offload: no page-locked host memory (%s): copies wait", exc)
                self.is_pinned = False
        if not self._rows and num_slots:
            self._rows = list(torch.empty(num_slots, block_bytes, dtype=torch.uint8).unbind(0))
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
        return self._rows[slot]

    def array(self, slot: int) -> np.ndarray:
        """The slot as a numpy array sharing its memory (for file I/O on worker threads)."""
        return self._rows[slot].numpy()

    def close(self) -> None:
        """Release the memory (the pinned allocator keeps it cached for torch)."""
        self._rows = []


def _pinned_rows(num_slots: int, block_bytes: int) -> list[torch.Tensor]:
    """`num_slots` page-locked images from allocations of exact powers of two bytes."""
    rows: list[torch.Tensor] = []
    left = num_slots * block_bytes
    while len(rows) < num_slots:
        size = 1 << max(left.bit_length() - 1, 0)
        if size < block_bytes:
            size = 1 << (block_bytes - 1).bit_length()  # the last block: one rounded allocation
        chunk = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        count = min(size // block_bytes, num_slots - len(rows))
        rows += list(chunk[: count * block_bytes].view(count, block_bytes).unbind(0))
        left -= count * block_bytes
    return rows
