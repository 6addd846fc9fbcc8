"""The persistent request-state table of runner V2: fixed request slots on the device.

Each slot holds one running request's token ids, block table and sampling parameters. A step
sends only what changed since the previous one (requests that arrived or came back after a
preemption, blocks appended, and the per-row step vectors) as one staged host-to-device copy;
finished and preempted requests just give their slot back. Rows of a step name slots, so the
batch can be reordered freely without moving any state.

A row marked `is_new` rebuilds its slot from the host (every known token, every block, the
parameters): a request back from a preemption, and one restated after a failed step
(`isolating_runner.restate`), whatever that step left half-written; a restated request keeps
the seed drawn for it, so its draws stay the same.

Slot `max_num_seqs` is the padding slot: it owns no block (its block-table row stays -1), so
CUDA-graph padding rows write no KV and read none.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import numpy as np
import torch

from davit_engine.core.batch import ScheduledRequest, SchedulerOutput
from davit_engine.kernels.input_prep import scatter_token_rows
from davit_engine.kernels.sampling import SamplingTable
from davit_engine.types import SamplingParams

# Columns of the per-slot parameter table (int32; float columns hold float32 bits).
TEMPERATURE, TOP_K, TOP_P, MIN_P, SEED, REPETITION, PRESENCE, FREQUENCY, PROMPT_LEN = range(9)
NUM_PARAM_COLUMNS = 9
_FLOAT_COLUMNS = (TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY)
# Per-row step vectors, at fixed offsets so captured graphs always read the same addresses.
# ROW_NUM_DRAFTS: real draft tokens a verifying row brings (0 for other rows).
ROW_SLOT, ROW_NUM_COMPUTED, ROW_NUM_NEW, ROW_NEEDS_SAMPLE, ROW_NUM_DRAFTS = range(5)
NUM_ROW_VECTORS = 5


def _float_bits(value: float) -> int:
    return int(struct.unpack("<i", struct.pack("<f", value))[0])


def param_row(params: SamplingParams, seed: int, num_prompt_tokens: int) -> list[int]:
    """One slot's parameter row (see the column constants)."""
    row = [0] * NUM_PARAM_COLUMNS
    row[TEMPERATURE] = _float_bits(0.0 if params.is_greedy else params.temperature)
    row[TOP_K] = params.top_k
    row[TOP_P] = _float_bits(params.top_p)
    row[MIN_P] = _float_bits(params.min_p)
    row[SEED] = int(np.uint32(seed & 0xFFFFFFFF).view(np.int32))
    row[REPETITION] = _float_bits(params.repetition_penalty)
    row[PRESENCE] = _float_bits(params.presence_penalty)
    row[FREQUENCY] = _float_bits(params.frequency_penalty)
    row[PROMPT_LEN] = num_prompt_tokens
    return row


@dataclass
class StepRows:
    """Device views of one step's row vectors, `B` rows (padding rows included)."""

    slot: torch.Tensor  # [B] int32
    num_computed: torch.Tensor  # [B] int32
    num_new: torch.Tensor  # [B] int32
    needs_sample: torch.Tensor  # [B] int32
    num_drafts: torch.Tensor | None = None  # [B] int32 (verifying rows' real drafts)


class RequestStateTable:
    """Slots, device tables and the staged per-step update.

    Host side it maps request ids to slots and remembers how many blocks of each slot the
    device already has. `stage(batch, num_rows)` fills a pinned buffer with the step's deltas and
    row vectors and issues one non-blocking copy; `apply` then scatters the deltas into the
    tables on the device stream.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_blocks_per_seq: int,
        device: torch.device,
        seed: int,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks_per_seq
        self.pad_slot = max_num_seqs
        self.device = device
        num_slots = max_num_seqs + 1
        # token_ids[slot, p]: token at position p (prompt, then outputs as they are drawn)
        self.token_ids = torch.zeros(num_slots, max_model_len, dtype=torch.int32, device=device)
        self.block_table = torch.full(
            (num_slots, max_blocks_per_seq), -1, dtype=torch.int32, device=device
        )
        self.params = torch.zeros(num_slots, NUM_PARAM_COLUMNS, dtype=torch.int32, device=device)
        as_float = self.params.view(torch.float32)
        self.sampling = SamplingTable(
            temperature=as_float[:, TEMPERATURE],
            top_k=self.params[:, TOP_K],
            top_p=as_float[:, TOP_P],
            min_p=as_float[:, MIN_P],
            seed=self.params[:, SEED],
        )
        self.repetition = as_float[:, REPETITION]
        self.presence = as_float[:, PRESENCE]
        self.frequency = as_float[:, FREQUENCY]
        self.prompt_len = self.params[:, PROMPT_LEN]
        # Row vectors of the current step at fixed device addresses (read by captured graphs).
        self.rows = torch.zeros(NUM_ROW_VECTORS, num_slots, dtype=torch.int32, device=device)
        self.rows[ROW_SLOT].fill_(self.pad_slot)
        self.rows[ROW_NUM_NEW].fill_(1)
        self._slot_of: dict[str, int] = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))
        self._num_blocks_sent = [0] * num_slots
        self._rng = random.Random(seed)
        self._seeds = [0] * num_slots  # the seed drawn for a slot's request without one
        # Pinned staging buffers used in turn, each guarded by the event of its last copy.
        self._pinned: list[torch.Tensor] = []
        self._pinned_ready: list[torch.cuda.Event | None] = []
        self._turn = 0
        self._device_stage = torch.empty(0, dtype=torch.int32, device=device)
        self.last_stage_size = 0  # int32 values the last step sent (row vectors + changes)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def release(self, request_ids: list[str]) -> None:
        """Give the slots of finished or preempted requests back (no device work)."""
        for request_id in request_ids:
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)
                self._num_blocks_sent[slot] = 0

    def stage(self, batch: SchedulerOutput, num_rows: int, pad_num_new: int = 1) -> StepRows:
        """Send this step's changes and row vectors; `num_rows >= len(batch.scheduled)` pads
        with rows on the padding slot (`pad_num_new` new tokens, nothing sampled).

        A verifying row's n-gram drafts are written after its last token (positions
        `num_computed + 1 ...`), where the input preparation reads them."""
        scheduled = batch.scheduled
        num_real = len(scheduled)
        new_params: list[list[int]] = []
        new_slots: list[int] = []
        token_rows: list[tuple[int, list[int]]] = []  # (slot, tokens from position 0)
        block_slots: list[int] = []
        block_cols: list[int] = []
        block_ids: list[int] = []
        draft_flat: list[int] = []  # slot * max_model_len + position of each n-gram draft
        draft_tokens: list[int] = []
        row_slots = np.full(num_rows, self.pad_slot, dtype=np.int32)
        width = self.max_model_len
        for i, req in enumerate(scheduled):
            slot = self._slot_of.get(req.request_id)
            if slot is None or req.is_new:
                slot = self._admit(req, new_slots, new_params, token_rows)
            row_slots[i] = slot
            if req.spec_token_ids:
                first = slot * width + req.num_computed_tokens + 1
                draft_flat.extend(range(first, first + len(req.spec_token_ids)))
                draft_tokens.extend(req.spec_token_ids)
            sent = self._num_blocks_sent[slot]
            if len(req.block_ids) > sent:
                fresh = req.block_ids[sent:]
                block_slots.extend([slot] * len(fresh))
                block_cols.extend(range(sent, len(req.block_ids)))
                block_ids.extend(fresh)
                self._num_blocks_sent[slot] = len(req.block_ids)

        num_tokens = sum(len(t) for _, t in token_rows)
        num_new = len(new_slots)
        num_appends = len(block_ids)
        num_drafts = len(draft_tokens)
        sizes = [
            NUM_ROW_VECTORS * num_rows,
            num_new * (1 + NUM_PARAM_COLUMNS),
            3 * len(token_rows),
            num_tokens,
            3 * num_appends,
            2 * num_drafts,
        ]
        host = self._next_pinned(sum(sizes))
        view = host.numpy()
        offset = 0
        rows_host = view[: NUM_ROW_VECTORS * num_rows].reshape(NUM_ROW_VECTORS, num_rows)
        rows_host[ROW_SLOT] = row_slots
        rows_host[ROW_NUM_COMPUTED, :num_real] = [r.num_computed_tokens for r in scheduled]
        rows_host[ROW_NUM_NEW, :num_real] = [r.num_new_tokens for r in scheduled]
        rows_host[ROW_NEEDS_SAMPLE, :num_real] = [r.needs_sample for r in scheduled]
        rows_host[ROW_NUM_DRAFTS, :num_real] = [r.num_draft_tokens for r in scheduled]
        rows_host[ROW_NUM_COMPUTED:, num_real:] = 0
        rows_host[ROW_NUM_NEW, num_real:] = pad_num_new
        offset += sizes[0]
        if num_new:
            block = view[offset : offset + sizes[1]].reshape(num_new, 1 + NUM_PARAM_COLUMNS)
            block[:, 0] = new_slots
            block[:, 1:] = new_params
        offset += sizes[1]
        token_offset = offset + sizes[2]
        if token_rows:
            headers = view[offset : offset + sizes[2]].reshape(-1, 3)
            cursor = 0
            for j, (slot, tokens) in enumerate(token_rows):
                headers[j] = (slot, cursor, len(tokens))
                view[token_offset + cursor : token_offset + cursor + len(tokens)] = tokens
                cursor += len(tokens)
        offset = token_offset + sizes[3]
        if num_appends:
            triples = view[offset : offset + sizes[4]].reshape(3, num_appends)
            triples[0] = block_slots
            triples[1] = block_cols
            triples[2] = block_ids
        offset += sizes[4]
        if num_drafts:
            pairs = view[offset : offset + sizes[5]].reshape(2, num_drafts)
            pairs[0] = draft_flat
            pairs[1] = draft_tokens

        total = sum(sizes)
        self.last_stage_size = total
        if self._device_stage.numel() < total:
            self._device_stage = torch.empty(
                max(total, 2 * self._device_stage.numel()), dtype=torch.int32, device=self.device
            )
        stage = self._device_stage[:total]
        stage.copy_(host[:total], non_blocking=True)
        self._mark_pinned_used()
        self._apply(stage, sizes, num_rows, num_new, token_rows, num_appends, num_drafts)
        rows = self.rows[:, :num_rows]
        return StepRows(
            slot=rows[ROW_SLOT],
            num_computed=rows[ROW_NUM_COMPUTED],
            num_new=rows[ROW_NUM_NEW],
            needs_sample=rows[ROW_NEEDS_SAMPLE],
            num_drafts=rows[ROW_NUM_DRAFTS],
        )

    def _admit(
        self,
        req: ScheduledRequest,
        new_slots: list[int],
        new_params: list[list[int]],
        token_rows: list[tuple[int, list[int]]],
    ) -> int:
        slot = self._slot_of.get(req.request_id)
        seed = req.sampling.seed
        if slot is None:
            if not self._free:
                raise RuntimeError(
                    f"runner V2 has no free request slot for {req.request_id} "
                    f"(max_num_seqs={self.max_num_seqs})"
                )
            slot = self._free.pop()
            self._slot_of[req.request_id] = slot
            if seed is None:
                seed = self._rng.getrandbits(32)
                self._seeds[slot] = seed
        elif seed is None:
            # Restated after a failed step: the same draws as had nothing failed.
            seed = self._seeds[slot]
        self._num_blocks_sent[slot] = 0
        new_slots.append(slot)
        new_params.append(param_row(req.sampling, seed, req.num_prompt_tokens))
        # Every token known now: the prompt, and the outputs of a request recomputed after a
        # preemption. Later outputs are drawn on the device straight into this row.
        known = req.token_ids[: self.max_model_len]
        token_rows.append((slot, list(known)))
        return slot

    def _apply(
        self,
        stage: torch.Tensor,
        sizes: list[int],
        num_rows: int,
        num_new: int,
        token_rows: list[tuple[int, list[int]]],
        num_appends: int,
        num_drafts: int = 0,
    ) -> None:
        offset = 0
        self.rows[:, :num_rows].copy_(stage[: sizes[0]].view(NUM_ROW_VECTORS, num_rows))
        offset += sizes[0]
        if num_new:
            block = stage[offset : offset + sizes[1]].view(num_new, 1 + NUM_PARAM_COLUMNS)
            self.params.index_copy_(0, block[:, 0].long(), block[:, 1:])
        offset += sizes[1]
        if token_rows:
            headers = stage[offset : offset + sizes[2]].view(-1, 3)
            tokens = stage[offset + sizes[2] : offset + sizes[2] + sizes[3]]
            max_len = max(len(t) for _, t in token_rows)
            scatter_token_rows(headers, tokens, self.token_ids, max_len)
        offset += sizes[2] + sizes[3]
        if num_appends:
            triples = stage[offset : offset + sizes[4]].view(3, num_appends).long()
            flat = triples[0] * self.max_blocks + triples[1]
            self.block_table.view(-1).index_copy_(0, flat, triples[2].int())
        offset += sizes[4]
        if num_drafts:
            pairs = stage[offset : offset + sizes[5]].view(2, num_drafts)
            self.token_ids.view(-1).index_copy_(0, pairs[0].long(), pairs[1])

    def _next_pinned(self, size: int) -> torch.Tensor:
        if len(self._pinned) < 2:
            self._pinned.append(torch.empty(0, dtype=torch.int32))
            self._pinned_ready.append(None)
        self._turn = (self._turn + 1) % len(self._pinned)
        ready = self._pinned_ready[self._turn]
        if ready is not None:
            ready.synchronize()  # its previous copy has left; normally long done
        if self._pinned[self._turn].numel() < size:
            self._pinned[self._turn] = torch.empty(
                max(size, 2 * self._pinned[self._turn].numel(), 4096),
                dtype=torch.int32,
                pin_memory=self.device.type == "cuda",
            )
        return self._pinned[self._turn]

    def _mark_pinned_used(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._pinned_ready[self._turn] = event
