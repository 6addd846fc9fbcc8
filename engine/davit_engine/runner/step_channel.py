"""How rank 0 hands each step's inputs to the other tensor-parallel ranks: two broadcasts of
tensors, no Python objects.

1. a header, 8 int64 on the host over the gloo control group:
   `[command, T, B, max_blocks, S, max_query_len, max_seq_len, argument]`;
2. for a step, one int64 payload on the model's device over the model's group (NCCL on GPUs):
   `input_ids [T] | positions [T] | slot_mapping [T] | query_start_loc [B+1] | seq_lens [B] |
   block_tables [B * max_blocks] | logits_index [S]`
   where `logits_index` lists the hidden rows whose logits the step computes.

Every rank then runs the same forward over the same tensors; the followers' share of the
logits goes to rank 0, which samples.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from davit_engine.layers.attention import AttentionBackend, AttentionMetadata
from davit_engine.layers.parallel import TensorParallel

HEADER_LEN = 8


class Command(enum.IntEnum):
    SHUTDOWN = 0
    STEP = 1
    INIT_KV_CACHE = 2  # argument: the number of KV blocks


@dataclass
class StepInputs:
    """One step's device tensors, identical on every rank."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [S] int64: hidden rows whose logits are computed


class StepChannel:
    """Rank 0 sends (`send_*`); the other ranks `receive()` in the same order."""

    def __init__(self, tp: TensorParallel, device: torch.device, backend: AttentionBackend) -> None:
        self.tp = tp
        self.device = device
        self.backend = backend
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)

    def _broadcast_header(self, values: list[int]) -> None:
        self._header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self._header[len(values) :] = 0
        dist.broadcast(self._header, src=0, group=self.tp.control_group)

    def send_command(self, command: Command, argument: int = 0) -> None:
        self._broadcast_header([int(command), 0, 0, 0, 0, 0, 0, argument])

    def send_step(self, step: StepInputs) -> None:
        meta = step.meta
        num_reqs, max_blocks = meta.block_tables.shape
        self._broadcast_header(
            [
                int(Command.STEP),
                int(step.input_ids.shape[0]),
                int(num_reqs),
                int(max_blocks),
                int(step.logits_index.shape[0]),
                meta.max_query_len,
                meta.max_seq_len,
                0,
            ]
        )
        payload = torch.cat(
            [
                step.input_ids,
                step.positions,
                meta.slot_mapping,
                meta.query_start_loc.to(torch.int64),
                meta.seq_lens.to(torch.int64),
                meta.block_tables.to(torch.int64).flatten(),
                step.logits_index,
            ]
        )
        dist.broadcast(payload, src=0, group=self.tp.group)

    def receive(self) -> tuple[Command, int, StepInputs | None]:
        """(command, argument, the step's inputs for STEP else None); blocks until rank 0
        sends."""
        dist.broadcast(self._header, src=0, group=self.tp.control_group)
        values = self._header.tolist()
        command = Command(values[0])
        if command != Command.STEP:
            return command, int(values[7]), None
        _, t, b, max_blocks, s, max_query_len, max_seq_len, _ = values
        sizes = [t, t, t, b + 1, b, b * max_blocks, s]
        payload = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0, group=self.tp.group)
        ids, pos, slots, qsl, seq_lens, tables, logits_index = payload.split(sizes)
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=qsl.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=tables.view(b, max_blocks).to(torch.int32),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            backend=self.backend,
        )
        return command, 0, StepInputs(ids, pos, meta, logits_index)
