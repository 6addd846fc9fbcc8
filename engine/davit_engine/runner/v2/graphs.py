"""CUDA graphs for decode steps: one graph per padded batch size, all in one memory pool.

A decode step of B requests replays the graph of the smallest captured size >= B; the extra
rows sit on the padding slot, which owns no KV block, so they write and read nothing. The
captured region reads only fixed device buffers (the state table's row vectors and tables), so
a replay needs no host work beyond the staged copy that precedes it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 128, then every 16: padding stays under ~12%."""
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, 129, 8))
    sizes += list(range(144, max_num_seqs + 1, 16))
    sizes = [s for s in sizes if s <= max_num_seqs]
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Captured decode steps. `step(num_rows)` must read and write only static buffers and
    return the logits tensor `[num_rows, V]` that the replay refreshes."""

    def __init__(self, step: Callable[[int], torch.Tensor], sizes: list[int]) -> None:
        self._step = step
        self.sizes = sorted(sizes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self) -> None:
        began = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        for size in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            self._step(size)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._step(size)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (batch %d..%d) in %.1f s, %.2f GiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - began,
            (free_before - torch.cuda.mem_get_info()[0]) / 2**30,
        )

    def padded_size(self, num_rows: int) -> int | None:
        """The captured size that serves `num_rows` rows, or None when none is large enough."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int) -> torch.Tensor:
        graph, out = self._graphs[size]
        graph.replay()
        return out
