"""Building one step's model inputs on the GPU from the persistent request-state table.

The runner keeps, per request slot, the request's token ids and block table on the device. A
step is described by three small vectors per batch row (slot, tokens already computed, new
tokens); one kernel expands them into the flat per-token inputs (token ids, positions, KV slot
mapping) and the per-request attention metadata (query start locations, sequence lengths,
gathered block tables, the index of each row's last token for the logits). Because the kernel
reads only device memory at fixed addresses, it can run inside a captured CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _prepare_inputs_kernel(  # type: ignore[no-untyped-def]
    row_slot_ptr,
    row_num_computed_ptr,
    row_num_new_ptr,
    token_table_ptr,
    block_table_ptr,
    input_ids_ptr,
    positions_ptr,
    slot_mapping_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_block_tables_ptr,
    logits_index_ptr,
    stride_token_table,
    stride_block_table,
    stride_out_block_tables,
    max_blocks,
    PAGE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_MB: tl.constexpr,
):
    row = tl.program_id(0)
    # This row's first token is the sum of the new tokens of the rows before it.
    others = tl.arange(0, BLOCK_B)
    earlier = tl.load(row_num_new_ptr + others, mask=others < row, other=0)
    start = tl.sum(earlier, 0)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    num_computed = tl.load(row_num_computed_ptr + row)
    num_new = tl.load(row_num_new_ptr + row)
    seq_len = num_computed + num_new

    if row == 0:
        tl.store(query_start_loc_ptr, 0)
    tl.store(query_start_loc_ptr + row + 1, start + num_new)
    tl.store(seq_lens_ptr + row, seq_len)
    tl.store(logits_index_ptr + row, tl.maximum(start + num_new - 1, 0).to(tl.int64))

    tokens = token_table_ptr + slot * stride_token_table
    blocks = block_table_ptr + slot * stride_block_table
    for chunk in range(0, num_new, BLOCK_T):
        j = chunk + tl.arange(0, BLOCK_T)
        valid = j < num_new
        pos = num_computed + j
        ids = tl.load(tokens + pos, mask=valid, other=0)
        block = tl.load(blocks + pos // PAGE, mask=valid, other=-1).to(tl.int64)
        kv_slot = tl.where(block >= 0, block * PAGE + pos % PAGE, -1)
        tl.store(input_ids_ptr + start + j, ids.to(tl.int64), mask=valid)
        tl.store(positions_ptr + start + j, pos.to(tl.int64), mask=valid)
        tl.store(slot_mapping_ptr + start + j, kv_slot, mask=valid)

    out_row = out_block_tables_ptr + row.to(tl.int64) * stride_out_block_tables
    for chunk in range(0, max_blocks, BLOCK_MB):
        c = chunk + tl.arange(0, BLOCK_MB)
        valid = c < max_blocks
        tl.store(out_row + c, tl.load(blocks + c, mask=valid), mask=valid)


@triton.jit
def _scatter_token_rows_kernel(  # type: ignore[no-untyped-def]
    headers_ptr,
    tokens_ptr,
    token_table_ptr,
    stride_token_table,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(headers_ptr + 3 * row).to(tl.int64)
    src = tl.load(headers_ptr + 3 * row + 1)
    length = tl.load(headers_ptr + 3 * row + 2)
    j = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = j < length
    values = tl.load(tokens_ptr + src + j, mask=valid)
    tl.store(token_table_ptr + slot * stride_token_table + j, values, mask=valid)


def scatter_token_rows(
    headers: torch.Tensor,  # [N, 3] int32: (slot, offset into tokens, length)
    tokens: torch.Tensor,  # [total] int32
    token_table: torch.Tensor,  # [num_slots, max_model_len] int32
    max_length: int,
) -> None:
    """`token_table[slot, :length] = tokens[offset : offset + length]` for every header row."""
    if headers.shape[0] == 0 or max_length == 0:
        return
    block = 1024
    grid = (headers.shape[0], triton.cdiv(max_length, block))
    _scatter_token_rows_kernel[grid](
        headers, tokens, token_table, token_table.stride(0), BLOCK=block
    )


def scatter_token_rows_reference(
    headers: torch.Tensor, tokens: torch.Tensor, token_table: torch.Tensor
) -> None:
    """Plain-torch twin of `scatter_token_rows`."""
    for slot, offset, length in headers.tolist():
        token_table[slot, :length] = tokens[offset : offset + length]


@dataclass
class StepInputs:
    """Views of one step's prepared inputs; shapes are [T] per token and [B] per row."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 where the slot has no block (padding)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    logits_index: torch.Tensor  # [B] int64: each row's last new token


class InputBuffers:
    """Fixed device buffers the kernel writes into, sized for the largest step."""

    def __init__(
        self, max_tokens: int, max_rows: int, max_blocks: int, device: torch.device
    ) -> None:
        def ints(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.max_rows = max_rows
        self.input_ids = ints(max_tokens, dtype=torch.int64)
        self.positions = ints(max_tokens, dtype=torch.int64)
        self.slot_mapping = ints(max_tokens, dtype=torch.int64)
        self.query_start_loc = ints(max_rows + 1)
        self.seq_lens = ints(max_rows)
        self.block_tables = ints(max_rows, max_blocks)
        self.logits_index = ints(max_rows, dtype=torch.int64)

    def view(self, num_tokens: int, num_rows: int) -> StepInputs:
        return StepInputs(
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: num_rows + 1],
            seq_lens=self.seq_lens[:num_rows],
            block_tables=self.block_tables[:num_rows],
            logits_index=self.logits_index[:num_rows],
        )


def prepare_inputs(
    row_slot: torch.Tensor,  # [B] int32
    row_num_computed: torch.Tensor,  # [B] int32
    row_num_new: torch.Tensor,  # [B] int32
    token_table: torch.Tensor,  # [num_slots, max_model_len] int32
    block_table: torch.Tensor,  # [num_slots, max_blocks] int32, -1 = no block
    buffers: InputBuffers,
    num_tokens: int,
    page: int,
) -> StepInputs:
    """Fill `buffers` for a step of `B = len(row_slot)` rows and `num_tokens` new tokens."""
    num_rows = int(row_slot.shape[0])
    max_blocks = int(block_table.shape[1])
    _prepare_inputs_kernel[(num_rows,)](
        row_slot,
        row_num_computed,
        row_num_new,
        token_table,
        block_table,
        buffers.input_ids,
        buffers.positions,
        buffers.slot_mapping,
        buffers.query_start_loc,
        buffers.seq_lens,
        buffers.block_tables,
        buffers.logits_index,
        token_table.stride(0),
        block_table.stride(0),
        buffers.block_tables.stride(0),
        max_blocks,
        PAGE=page,
        BLOCK_B=triton.next_power_of_2(max(buffers.max_rows, 2)),
        BLOCK_T=256,
        BLOCK_MB=min(256, triton.next_power_of_2(max(max_blocks, 2))),
        num_warps=4,
    )
    return buffers.view(num_tokens, num_rows)


def prepare_inputs_reference(
    row_slot: torch.Tensor,
    row_num_computed: torch.Tensor,
    row_num_new: torch.Tensor,
    token_table: torch.Tensor,
    block_table: torch.Tensor,
    page: int,
) -> StepInputs:
    """Plain-torch twin of `prepare_inputs`."""
    slots = row_slot.long()
    computed = row_num_computed.long()
    new = row_num_new.long()
    qsl = torch.zeros(len(slots) + 1, dtype=torch.int64, device=slots.device)
    qsl[1:] = torch.cumsum(new, 0)
    ids, positions, mapping = [], [], []
    for slot, c, n in zip(slots.tolist(), computed.tolist(), new.tolist(), strict=True):
        pos = torch.arange(c, c + n, device=slots.device)
        ids.append(token_table[slot, pos].long())
        blocks = block_table[slot, pos // page].long()
        mapping.append(torch.where(blocks >= 0, blocks * page + pos % page, -1))
        positions.append(pos)
    empty = torch.zeros(0, dtype=torch.int64, device=slots.device)
    return StepInputs(
        input_ids=torch.cat(ids) if ids else empty,
        positions=torch.cat(positions) if positions else empty,
        slot_mapping=torch.cat(mapping) if mapping else empty,
        query_start_loc=qsl.int(),
        seq_lens=(computed + new).int(),
        block_tables=block_table[slots],
        logits_index=(qsl[1:] - 1).clamp(min=0),
    )
