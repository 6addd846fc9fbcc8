"""CUDA graphs for decode steps: one graph per padded batch size, all in one memory pool.

A decode step of B requests replays the graph of the smallest captured size >= B; the extra
rows sit on the padding slot, which owns no KV block, so they write and read nothing. The
captured region reads only fixed device buffers (the state table's row vectors and tables), so
a replay needs no host work beyond the staged copy that precedes it.

Every graph writes its logits into the first rows of one float32 buffer `[max size, V]`,
allocated once outside the pool. A graph's own intermediates are freed before its capture
ends, so the graphs captured after it reuse that pool memory: the pool holds about one graph's
intermediates instead of every graph's logits. A replay overwrites the logits of the previous
one; the runner samples them on the same stream before it launches the next step.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from davit_contract.graphs import graph_logits_bytes

logger = logging.getLogger(__name__)


class Replayable(Protocol):
    """A captured step (a `torch.cuda.CUDAGraph`)."""

    def replay(self) -> None: ...


class DecodeGraphs:
    """Captured decode steps sharing one logits buffer.

    `step(num_rows, out)` must read and write only static buffers and write the logits of its
    `num_rows` rows into `out` (`[num_rows * tokens_per_row, V]` float32, the first rows of
    `logits`). The buffer is allocated here, outside the graph pool; `replay(size)` returns
    those rows, valid until the next replay. Verification steps of speculative decoding use
    `tokens_per_row = K + 1` (every position of every row has logits).
    """

    def __init__(
        self,
        step: Callable[[int, torch.Tensor], None],
        sizes: list[int],
        vocab_size: int,
        device: torch.device,
        tokens_per_row: int = 1,
        name: str = "decode",
    ) -> None:
        self._step = step
        self.sizes = sorted(sizes)
        self.tokens_per_row = tokens_per_row
        self.name = name
        # logits: [max size * tokens_per_row, V] float32, written by every graph
        self.logits = torch.empty(
            self.sizes[-1] * tokens_per_row, vocab_size, dtype=torch.float32, device=device
        )
        self._graphs: dict[int, Replayable] = {}
        self.pool = torch.cuda.graph_pool_handle()

    @property
    def logits_bytes(self) -> int:
        return graph_logits_bytes(self.sizes[-1] * self.tokens_per_row, self.logits.shape[1])

    def capture(self) -> None:
        began = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        for size in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            self._graphs[size] = self._capture_size(size)
        torch.cuda.synchronize()
        logger.info(
            "captured %d %s graphs (batch %d..%d) in %.1f s: %.2f GiB of graph pool, "
            "%.2f GiB of shared logits beside it",
            len(self.sizes),
            self.name,
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - began,
            (free_before - torch.cuda.mem_get_info()[0]) / 2**30,
            self.logits_bytes / 2**30,
        )

    def _capture_size(self, size: int) -> Replayable:
        out = self.logits[: size * self.tokens_per_row]
        self._step(size, out)  # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            # Everything the step allocates besides `out` is freed when it returns, inside
            # the capture: the next (smaller) graph reuses that pool memory.
            self._step(size, out)
        return graph

    def padded_size(self, num_rows: int) -> int | None:
        """The captured size that serves `num_rows` rows, or None when none is large enough."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of captured size `size`; its logits: `[size * tokens_per_row, V]`
        float32."""
        self._graphs[size].replay()
        return self.logits[: size * self.tokens_per_row]
