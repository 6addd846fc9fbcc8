"""Tensor parallelism's building blocks: a rank's place in the group, the all-reduce that ends a
row-parallel projection, and the vocabulary-parallel embedding and LM head.

The model file stays single-device: `davit_engine.models.parallel` builds it with one rank's
heads and MLP columns and swaps in these modules afterwards. Collectives go through
`torch.distributed` on `TensorParallel.group` (NCCL between GPUs, gloo on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """This process's rank among `size` ranks that each hold 1/size of every sharded weight.

    `group` carries the model's collectives on its device (None: the default group);
    `control_group` is a gloo group for host-side control messages (step headers, the KV block
    count), whose waits may last as long as the engine idles.
    """

    rank: int
    size: int
    group: Any = None  # torch.distributed ProcessGroup; Any: its stubs differ across versions
    control_group: Any = None

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that schedules and samples."""
        return self.rank == 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        dist.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` any rank holds (on the control group)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())


def rows_per_rank(vocab_size: int, size: int) -> int:
    """Vocabulary rows each rank holds: the vocabulary padded up to a multiple of `size`."""
    return -(-vocab_size // size)


def reduce_output_hook(tp: TensorParallel) -> Any:
    """A forward hook that all-reduces a module's output: installed on the attention and MLP
    blocks, whose last projection (o_proj, down_proj) is row-parallel and yields partial sums.
    The hook sits on the block, not on the projection, so a runner may swap the projection
    (pre-packed or quantized linears) without losing the reduction."""

    def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce_(output)

    return hook


class VocabParallelEmbedding(nn.Module):
    """Rows `[rank * n, (rank + 1) * n)` of the embedding table, `n = rows_per_rank(...)`.

    `forward(ids [T]) -> [T, hidden]`: each rank looks up the ids it holds, zeros the others,
    and the all-reduce adds the ranks' rows (exactly one rank contributes each token). Padding
    rows past the vocabulary stay zero and are never looked up.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_rows = rows_per_rank(vocab_size, tp.size)
        self.start = tp.rank * self.num_rows
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)  # [T] bool
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce_(out)


class VocabParallelLMHead(nn.Module):
    """The LM head split by vocabulary rows like `VocabParallelEmbedding` (and tied to it when
    the checkpoint ties them).

    `forward(hidden [N, hidden])`: every rank computes its `[N, n]` slice of the logits and
    sends it to rank 0, which returns the whole `[N, vocab]` (sampling happens once, there);
    the other ranks return their own slice, which nobody reads.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_rows = rows_per_rank(vocab_size, tp.size)
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(self.num_rows, hidden_size))
        # The rank's rows as another module (an FP8 LM head: quant/fp8_linear.py), or None:
        # `weight` in the model dtype.
        self.projection: nn.Module | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.projection is not None:
            local = self.projection(hidden)  # [N, n]
        else:
            assert self.weight is not None
            local = F.linear(hidden, self.weight)
        if not self.tp.is_leader:
            dist.gather(local, None, dst=0, group=self.tp.group)
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.gather(local, parts, dst=0, group=self.tp.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]  # [N, vocab]
