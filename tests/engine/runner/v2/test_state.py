"""The request-state table: what one staged copy carries, and what lands on the device."""

from __future__ import annotations

import torch

from davit_engine.core.batch import ScheduledRequest, SchedulerOutput
from davit_engine.runner.v2.state import NUM_ROW_VECTORS, RequestStateTable
from davit_engine.types import SamplingParams


def _request(
    request_id: str,
    tokens: list[int],
    computed: int,
    new: int,
    blocks: list[int],
    is_new: bool,
    params: SamplingParams,
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        num_computed_tokens=computed,
        num_new_tokens=new,
        block_ids=blocks,
        sampling=params,
        needs_sample=True,
        is_new=is_new,
    )


def test_steps_send_only_what_changed(device: torch.device) -> None:
    table = RequestStateTable(
        max_num_seqs=2, max_model_len=16, max_blocks_per_seq=4, device=device, seed=0
    )
    greedy = SamplingParams(temperature=0.0, seed=5, repetition_penalty=1.5)
    prompt = [11, 12, 13, 14, 15]
    # admission: the row vectors, one parameter row, the prompt, two block ids
    first = _request("a", prompt, 0, 5, [7, 3], True, greedy)
    rows = table.stage(SchedulerOutput([first]), 1)
    assert table.last_stage_size == NUM_ROW_VECTORS + (1 + 9) + 3 + 5 + 3 * 2
    slot = table.slot_of("a")
    assert table.token_ids[slot, :5].tolist() == prompt
    assert table.block_table[slot, :2].tolist() == [7, 3]
    assert float(table.sampling.temperature[slot]) == 0.0
    assert int(table.sampling.seed[slot]) == 5
    assert float(table.repetition[slot]) == 1.5
    assert int(table.prompt_len[slot]) == 5
    assert rows.slot.tolist() == [slot] and rows.num_new.tolist() == [5]

    # a decode step inside the known blocks, padded to 2 rows: only the row vectors travel
    decode = _request("a", prompt, 5, 1, [7, 3], False, greedy)
    rows = table.stage(SchedulerOutput([decode]), 2)
    assert table.last_stage_size == NUM_ROW_VECTORS * 2
    assert rows.slot.tolist() == [slot, table.pad_slot]
    assert rows.num_computed.tolist() == [5, 0] and rows.needs_sample.tolist() == [1, 0]

    # crossing into a third block: one (slot, column, block) triple more
    grow = _request("a", prompt, 8, 1, [7, 3, 9], False, greedy)
    table.stage(SchedulerOutput([grow]), 1)
    assert table.last_stage_size == NUM_ROW_VECTORS + 3
    assert table.block_table[slot, :3].tolist() == [7, 3, 9]

    # finished: the slot is reused by the next request, which brings its own state
    other = _request("b", [21, 22], 0, 2, [4], True, SamplingParams(temperature=0.7))
    table.stage(SchedulerOutput([other], finished_ids=[]), 1)
    assert table.slot_of("b") != slot
    table.release(["a"])
    third = _request("c", [31], 0, 1, [5], True, SamplingParams())
    table.stage(SchedulerOutput([third]), 1)
    assert table.slot_of("c") == slot
    assert table.token_ids[slot, :1].tolist() == [31]
    assert table.block_table[slot, 0].item() == 5
    assert abs(float(table.sampling.temperature[slot]) - 1.0) < 1e-6
    assert int(table.prompt_len[slot]) == 1
    # the padding slot never gets a block
    assert (table.block_table[table.pad_slot] == -1).all()
