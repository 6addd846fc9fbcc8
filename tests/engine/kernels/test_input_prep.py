from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.input_prep import InputBuffers, prepare_inputs, prepare_inputs_reference


def _check(
    device: torch.device,
    slots: list[int],
    computed: list[int],
    new: list[int],
    num_slots: int,
    max_len: int,
    page: int,
) -> None:
    max_blocks = -(-max_len // page)
    token_table = torch.randint(0, 1000, (num_slots, max_len), dtype=torch.int32, device=device)
    block_table = torch.randint(0, 500, (num_slots, max_blocks), dtype=torch.int32, device=device)
    block_table[-1] = -1  # the padding slot owns no block
    row_slot = torch.tensor(slots, dtype=torch.int32, device=device)
    row_computed = torch.tensor(computed, dtype=torch.int32, device=device)
    row_new = torch.tensor(new, dtype=torch.int32, device=device)
    buffers = InputBuffers(sum(new) + 5, len(slots) + 3, max_blocks, device)
    for buf in (buffers.input_ids, buffers.positions, buffers.slot_mapping):
        buf.fill_(-7)  # poison: every element of the step's view must be written
    ours = prepare_inputs(
        row_slot, row_computed, row_new, token_table, block_table, buffers, sum(new), page
    )
    ref = prepare_inputs_reference(row_slot, row_computed, row_new, token_table, block_table, page)
    for name in (
        "input_ids",
        "positions",
        "slot_mapping",
        "query_start_loc",
        "seq_lens",
        "block_tables",
        "logits_index",
    ):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name


def test_mixed_step(device: torch.device) -> None:
    torch.manual_seed(0)
    _check(device, [3, 0, 5, 1], [10, 0, 31, 7], [1, 13, 1, 4], 8, 40, 4)


def test_decode_step_with_padding_rows(device: torch.device) -> None:
    torch.manual_seed(1)
    # the last two rows are CUDA-graph padding on the padding slot (7): slot mapping -1
    _check(device, [2, 4, 7, 7], [5, 9, 0, 0], [1, 1, 1, 1], 8, 16, 4)


@pytest.mark.gpu
def test_large_prefill_and_decode(device: torch.device) -> None:
    torch.manual_seed(2)
    slots = list(range(200))
    computed = [int(x) for x in torch.randint(0, 1000, (200,))]
    new = [1] * 190 + [700] * 10
    _check(device, slots, computed, new, 257, 2048, 16)


def test_scatter_token_rows(device: torch.device) -> None:
    from davit_engine.kernels.input_prep import scatter_token_rows, scatter_token_rows_reference

    torch.manual_seed(3)
    table = torch.randint(0, 9, (5, 2100), dtype=torch.int32, device=device)
    tokens = torch.randint(100, 200, (2060,), dtype=torch.int32, device=device)
    headers = torch.tensor([[3, 0, 3], [0, 3, 2050], [4, 2053, 7]], dtype=torch.int32)
    ours, ref = table.clone(), table.clone()
    scatter_token_rows(headers.to(device), tokens, ours, 2050)
    scatter_token_rows_reference(headers, tokens, ref)
    assert torch.equal(ours, ref)
