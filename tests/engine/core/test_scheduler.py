"""Scheduler behaviour, driven step by step with the simulated runner."""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from davit_engine.core.batch import RunnerOutput
from davit_engine.core.request import RequestStatus
from davit_engine.core.scheduler import QueueFullError, Scheduler
from davit_engine.types import EngineRequest, FinishReason, ParamError, SamplingParams

from .sim import SimRunner, make_config, output_tokens, reference_outputs, run_to_completion

BS = 4


def ereq(name: str, tokens: list[int] | int, max_tokens: int = 8, **sampling: Any) -> EngineRequest:
    # A count gives a prompt of its own per name, so unrelated requests share no prefix.
    start = 1000 * (1 + zlib.crc32(name.encode()) % 1000)
    prompt = list(range(start, start + tokens)) if isinstance(tokens, int) else tokens
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return EngineRequest(name, prompt, params)


def make(
    num_blocks: int = 64, max_model_len: int = 256, **config: object
) -> tuple[Scheduler, SimRunner]:
    scheduler = Scheduler(make_config(**config), num_blocks=num_blocks, max_model_len=max_model_len)
    return scheduler, SimRunner(num_blocks, BS)


def step(scheduler: Scheduler, runner: SimRunner) -> list[tuple[str, int, bool]]:
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    return [(r.request_id, r.num_new_tokens, r.needs_sample) for r in out.scheduled]


def test_single_request_prefill_then_decode() -> None:
    scheduler, runner = make()
    scheduler.add_request(ereq("a", 10, max_tokens=3))
    out = scheduler.schedule()
    (sreq,) = out.scheduled
    assert (sreq.num_computed_tokens, sreq.num_new_tokens, sreq.needs_sample, sreq.is_new) == (
        0,
        10,
        True,
        True,
    )
    assert len(sreq.block_ids) == 3
    deltas = scheduler.update_from_output(out, runner.execute(out))
    assert [d.num_prompt_tokens for d in deltas] == [10]
    out = scheduler.schedule()
    (sreq,) = out.scheduled
    assert (sreq.num_computed_tokens, sreq.num_new_tokens, sreq.is_new) == (10, 1, False)
    req = scheduler.get_request("a")
    assert req is not None
    assert sreq.token_ids is req.token_ids, "token ids are shared, not copied per step"
    scheduler.update_from_output(out, runner.execute(out))
    out = scheduler.schedule()
    deltas = scheduler.update_from_output(out, runner.execute(out))
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert scheduler.get_request("a") is None
    assert not scheduler.has_unfinished()
    assert scheduler.schedule().finished_ids == ["a"]
    assert scheduler.schedule().finished_ids == []


def test_chunked_prefill_respects_the_token_budget() -> None:
    scheduler, runner = make(max_num_batched_tokens=16)
    scheduler.add_request(ereq("long", 40, max_tokens=2))
    scheduler.add_request(ereq("short", 6, max_tokens=2))
    assert step(scheduler, runner) == [("long", 16, False)]
    assert step(scheduler, runner) == [("long", 16, False)]
    # The last chunk samples; the budget left over admits the next request's first chunk.
    assert step(scheduler, runner) == [("long", 8, True), ("short", 6, True)]
    assert step(scheduler, runner) == [("long", 1, True), ("short", 1, True)]
    assert not scheduler.has_unfinished()
    assert all(out.num_batched_tokens <= 16 for out in runner.steps)


def test_prefill_chunks_give_the_same_output_as_one_piece() -> None:
    requests = [ereq(f"r{i}", 13 + 7 * i, max_tokens=5) for i in range(5)]
    expected = reference_outputs(requests, max_model_len=256)
    scheduler, runner = make(max_num_batched_tokens=9)
    for r in requests:
        scheduler.add_request(r)
    deltas = run_to_completion(scheduler, runner)
    assert {k: output_tokens(v) for k, v in deltas.items()} == expected


def test_decodes_are_served_before_new_prefills() -> None:
    scheduler, runner = make(max_num_batched_tokens=8)
    scheduler.add_request(ereq("a", 4, max_tokens=5))
    step(scheduler, runner)
    scheduler.add_request(ereq("b", 30, max_tokens=1))
    assert step(scheduler, runner) == [("a", 1, True), ("b", 7, False)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    scheduler, runner = make(
        max_num_batched_tokens=24, enable_chunked_prefill=False, max_model_len=24
    )
    scheduler.add_request(ereq("a", 10, max_tokens=3))
    scheduler.add_request(ereq("a2", 10, max_tokens=3))
    scheduler.add_request(ereq("b", 23, max_tokens=1))
    scheduler.add_request(ereq("c", 2, max_tokens=1))
    assert step(scheduler, runner) == [("a", 10, True), ("a2", 10, True)]
    # b does not fit beside the two decodes, and c must not overtake it (FCFS).
    assert step(scheduler, runner) == [("a", 1, True), ("a2", 1, True)]
    assert step(scheduler, runner) == [("a", 1, True), ("a2", 1, True)]
    assert step(scheduler, runner) == [("b", 23, True)]
    assert step(scheduler, runner) == [("c", 2, True)]
    assert not scheduler.has_unfinished()


def test_chunking_disabled_needs_a_budget_of_max_model_len() -> None:
    with pytest.raises(ParamError) as info:
        Scheduler(
            make_config(enable_chunked_prefill=False, max_num_batched_tokens=16),
            num_blocks=64,
            max_model_len=64,
        )
    assert info.value.param == "--max-num-batched-tokens"


def test_max_num_seqs_is_respected() -> None:
    scheduler, runner = make(max_num_seqs=3)
    for i in range(7):
        scheduler.add_request(ereq(f"r{i}", 5, max_tokens=4))
    counts = []
    while scheduler.has_unfinished():
        counts.append(len(step(scheduler, runner)))
        assert scheduler.num_running <= 3
    assert max(counts) == 3
    # FCFS: the first three run first.
    assert [s.request_id for s in runner.steps[0].scheduled] == ["r0", "r1", "r2"]


def test_prefix_hit_is_not_recomputed_and_reported() -> None:
    scheduler, runner = make()
    system = list(range(500, 520))  # 5 full blocks
    scheduler.add_request(ereq("a", [*system, 1, 2, 3], max_tokens=2))
    run_to_completion(scheduler, runner)
    computed_before = runner.num_computed_total
    scheduler.add_request(ereq("b", [*system, 7, 8], max_tokens=2))
    out = scheduler.schedule()
    (sreq,) = out.scheduled
    assert (sreq.num_computed_tokens, sreq.num_new_tokens) == (20, 2)
    deltas = scheduler.update_from_output(out, runner.execute(out))
    assert runner.num_computed_total - computed_before == 2
    assert (deltas[0].num_cached_tokens, deltas[0].num_prompt_tokens) == (20, 22)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (23 + 22, 20)
    # Same output as without any cache.
    rest = run_to_completion(scheduler, runner)
    expected = reference_outputs([ereq("b", [*system, 7, 8], max_tokens=2)], max_model_len=256)
    assert [deltas[0].new_token_ids[0], *output_tokens(rest["b"])] == expected["b"]


def test_identical_prompt_recomputes_only_its_last_block() -> None:
    scheduler, runner = make()
    prompt = list(range(300, 316))  # exactly 4 blocks
    scheduler.add_request(ereq("a", prompt, max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(ereq("b", prompt, max_tokens=1))
    (sreq,) = scheduler.schedule().scheduled
    assert (sreq.num_computed_tokens, sreq.num_new_tokens, sreq.needs_sample) == (12, 4, True)


def test_decode_blocks_become_cached() -> None:
    scheduler, runner = make()
    scheduler.add_request(ereq("a", 6, max_tokens=6))  # 6 prompt + 6 outputs = 3 full blocks
    deltas = run_to_completion(scheduler, runner)
    a_prompt = ereq("a", 6).prompt_token_ids
    full = [*a_prompt, *output_tokens(deltas["a"])]
    # The last output's K/V were never computed, so only 2 blocks' worth is cached.
    scheduler.add_request(ereq("b", [*full, 5], max_tokens=1))
    (sreq,) = scheduler.schedule().scheduled
    assert sreq.num_computed_tokens == 8


def test_preemption_under_block_pressure_keeps_outputs_identical() -> None:
    requests = [ereq(f"r{i}", 6 + i, max_tokens=20) for i in range(6)]
    expected = reference_outputs(requests, max_model_len=256)
    # 6 requests x up to 32 tokens = up to 48 blocks wanted; only 16 exist.
    scheduler, runner = make(num_blocks=16, enable_prefix_caching=False)
    for r in requests:
        scheduler.add_request(r)
    deltas = run_to_completion(scheduler, runner)
    assert {k: output_tokens(v) for k, v in deltas.items()} == expected
    preempted = [rid for out in runner.steps for rid in out.preempted_ids]
    assert preempted, "the pool was meant to be too small for all requests at once"
    assert scheduler.stats().num_preemptions == len(preempted)
    assert scheduler.stats().num_free_blocks == 16


def test_preempted_request_comes_back_new_with_its_outputs_as_prompt() -> None:
    scheduler, runner = make(num_blocks=6, enable_prefix_caching=False)
    scheduler.add_request(ereq("old", 8, max_tokens=12))  # grows to 5 blocks
    scheduler.add_request(ereq("new", 8, max_tokens=12))
    victim_out = None
    for _ in range(20):
        out = scheduler.schedule()
        if out.preempted_ids:
            victim_out = out
            scheduler.update_from_output(out, runner.execute(out))
            break
        scheduler.update_from_output(out, runner.execute(out))
    assert victim_out is not None
    assert victim_out.preempted_ids == ["new"]  # the most recently admitted goes
    assert [s.request_id for s in victim_out.scheduled] == ["old"]
    victim = scheduler.get_request("new")
    assert victim is not None
    assert victim.status is RequestStatus.PREEMPTED
    assert victim.block_ids == [] and victim.num_computed_tokens == 0
    num_outputs = victim.num_output_tokens
    assert num_outputs > 0
    assert scheduler.num_waiting == 1
    # Later it is recomputed in one go (prompt + outputs so far) and then samples.
    while True:
        out = scheduler.schedule()
        back = [s for s in out.scheduled if s.request_id == "new"]
        scheduler.update_from_output(out, runner.execute(out))
        if back:
            break
    (sreq,) = back
    assert sreq.is_new and sreq.num_computed_tokens == 0
    assert sreq.num_new_tokens == 8 + num_outputs
    assert sreq.num_prompt_tokens == 8


def test_prompt_too_long_for_the_model_is_rejected() -> None:
    scheduler, _ = make(max_model_len=16)
    with pytest.raises(ParamError) as info:
        scheduler.add_request(ereq("a", 16))
    assert info.value.param == "prompt"
    assert "16" in info.value.message
    scheduler.add_request(ereq("b", 15))
    assert scheduler.num_waiting == 1


def test_request_larger_than_the_kv_cache_is_rejected_not_livelocked() -> None:
    scheduler, runner = make(num_blocks=4, max_model_len=1000)  # 16 tokens of KV in all
    assert scheduler.max_model_len == 16
    with pytest.raises(ParamError) as info:
        scheduler.add_request(ereq("huge", 16))
    assert info.value.param == "prompt"
    assert "KV cache" in info.value.message
    # One that fits starts, and stops with LENGTH when the cache is full.
    scheduler.add_request(ereq("fits", 10, max_tokens=100))
    deltas = run_to_completion(scheduler, runner)
    assert len(output_tokens(deltas["fits"])) == 6
    assert deltas["fits"][-1].finish_reason is FinishReason.LENGTH


def test_empty_prompt_and_duplicate_id_are_rejected() -> None:
    scheduler, _ = make()
    with pytest.raises(ParamError) as info:
        scheduler.add_request(ereq("a", []))
    assert info.value.param == "prompt"
    scheduler.add_request(ereq("a", 3))
    with pytest.raises(ParamError) as info:
        scheduler.add_request(ereq("a", 3))
    assert info.value.param == "request_id"
    assert scheduler.num_waiting == 1


def test_queue_full_rejects_and_every_accepted_request_completes() -> None:
    # Few blocks force preemptions, which put requests back in the queue: still none is lost.
    scheduler, runner = make(num_blocks=7, max_num_seqs=2, max_queue_len=3)
    accepted, rejected = [], []
    for i in range(12):
        try:
            scheduler.add_request(ereq(f"r{i}", 5 + i, max_tokens=10))
            accepted.append(f"r{i}")
        except QueueFullError as err:
            assert err.retry_after > 0
            assert "--max-queue-len 3" in str(err)
            rejected.append(f"r{i}")
    # Two free running slots plus three queued.
    assert accepted == ["r0", "r1", "r2", "r3", "r4"]
    for i in range(12, 40):
        step(scheduler, runner)
        try:
            scheduler.add_request(ereq(f"r{i}", 5, max_tokens=10))
            accepted.append(f"r{i}")
        except QueueFullError:
            rejected.append(f"r{i}")
    deltas = run_to_completion(scheduler, runner)
    finished = {rid for out in runner.steps for rid in out.finished_ids}
    finished |= set(scheduler.schedule().finished_ids)
    assert finished == set(accepted)
    assert all(len(output_tokens(deltas[rid])) > 0 for rid in deltas)
    assert rejected
    assert scheduler.stats().num_preemptions > 0
    assert scheduler.stats().num_free_blocks == 7


def test_queue_len_zero_accepts_only_what_free_slots_take() -> None:
    scheduler, _ = make(max_num_seqs=2, max_queue_len=0)
    scheduler.add_request(ereq("a", 4))
    scheduler.add_request(ereq("b", 4))
    with pytest.raises(QueueFullError):
        scheduler.add_request(ereq("c", 4))


def test_abort_frees_blocks_of_waiting_and_running_requests() -> None:
    scheduler, runner = make(num_blocks=32, max_num_batched_tokens=16)
    scheduler.add_request(ereq("run", 10, max_tokens=50))
    scheduler.add_request(ereq("chunk", 30, max_tokens=50))
    scheduler.add_request(ereq("wait", 10, max_tokens=50))
    step(scheduler, runner)
    step(scheduler, runner)
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    assert scheduler.stats().num_free_blocks < 32
    assert scheduler.abort("wait")
    assert scheduler.abort("chunk")  # mid-prefill
    assert scheduler.abort("run")
    assert not scheduler.abort("run")
    assert not scheduler.abort("unknown")
    assert scheduler.stats().kv_cache_usage == 0.0
    assert not scheduler.has_unfinished()
    assert sorted(scheduler.schedule().finished_ids) == ["chunk", "run", "wait"]
    scheduler.block_manager.check_invariants([])


def test_abort_while_a_step_is_in_flight_drops_its_samples() -> None:
    scheduler, runner = make()
    scheduler.add_request(ereq("a", 5))
    scheduler.add_request(ereq("b", 5))
    out = scheduler.schedule()
    res = runner.execute(out)
    assert scheduler.abort("a")
    deltas = scheduler.update_from_output(out, res)
    assert [d.request_id for d in deltas] == ["b"]
    scheduler.block_manager.check_invariants([r for r in [scheduler.get_request("b")] if r])


def test_runner_output_of_the_wrong_length_is_refused() -> None:
    scheduler, _ = make()
    scheduler.add_request(ereq("a", 5))
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="1 scheduled"):
        scheduler.update_from_output(out, RunnerOutput([]))


def test_finishing_rules_through_the_scheduler() -> None:
    scheduler, _ = make(max_model_len=12)
    eos = 77
    cases = {
        "eos": SamplingParams(max_tokens=10),
        "ignore_eos": SamplingParams(max_tokens=3, ignore_eos=True),
        "min_tokens": SamplingParams(max_tokens=10, min_tokens=2),
        "stop_id": SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(55,)),
        "model_len": SamplingParams(max_tokens=100, ignore_eos=True),
    }
    for name, params in cases.items():
        scheduler.add_request(EngineRequest(name, [1, 2, 3, 4, 5, 6], params, eos_token_ids=(eos,)))
    # A scripted runner: always EOS, except stop_id gets 55 on its second token.
    deltas: dict[str, list[int]] = {name: [] for name in cases}
    reasons = {}
    stop_ids = {}
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        sampled: list[int | None] = []
        for s in out.scheduled:
            if s.request_id == "stop_id":
                sampled.append(55 if s.num_output_tokens == 1 else eos)
            else:
                sampled.append(eos)
        for d in scheduler.update_from_output(out, RunnerOutput(sampled)):
            deltas[d.request_id] += d.new_token_ids
            if d.finished:
                reasons[d.request_id] = d.finish_reason
                stop_ids[d.request_id] = d.stop_token_id
    assert deltas["eos"] == [eos] and reasons["eos"] is FinishReason.STOP
    assert stop_ids["eos"] is None
    assert deltas["ignore_eos"] == [eos] * 3 and reasons["ignore_eos"] is FinishReason.LENGTH
    assert deltas["min_tokens"] == [eos, eos] and reasons["min_tokens"] is FinishReason.STOP
    assert deltas["stop_id"] == [eos, 55] and reasons["stop_id"] is FinishReason.STOP
    assert stop_ids["stop_id"] == 55
    assert deltas["model_len"] == [eos] * 6 and reasons["model_len"] is FinishReason.LENGTH


def test_logprobs_pass_through() -> None:
    scheduler, runner = make()
    scheduler.add_request(ereq("with", 5, max_tokens=2, logprobs=2))
    scheduler.add_request(ereq("without", 5, max_tokens=2))
    deltas = run_to_completion(scheduler, runner)
    for d in deltas["with"]:
        assert d.logprobs is not None and d.logprobs[0].token_id == d.new_token_ids[0]
    assert all(d.logprobs is None for d in deltas["without"])


def test_stats_counters() -> None:
    scheduler, runner = make(num_blocks=20)
    scheduler.add_request(ereq("a", 9, max_tokens=3))
    scheduler.add_request(ereq("b", 9, max_tokens=3))
    scheduler.add_request(ereq("c", 9, max_tokens=3))
    stats = scheduler.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_total_blocks) == (3, 0, 20)
    step(scheduler, runner)
    stats = scheduler.stats()
    assert (stats.num_waiting, stats.num_running) == (0, 3)
    assert stats.num_free_blocks == 20 - 9
    assert stats.kv_cache_usage == pytest.approx(9 / 20)
    assert stats.prompt_tokens_total == 27 and stats.generation_tokens_total == 3
    run_to_completion(scheduler, runner)
    stats = scheduler.stats()
    assert stats.generation_tokens_total == 9
    assert stats.prompt_tokens_total == 27
    # Same prompt: b and c were admitted in the same step as a, before a's blocks were cached.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (27, 0)
    assert stats.kv_cache_usage == 0.0 and stats.num_free_blocks == 20


def test_admission_keeps_a_reserve_only_while_others_run() -> None:
    scheduler, runner = make(num_blocks=10)  # reserve: 1 block
    scheduler.add_request(ereq("a", 7, max_tokens=1))  # 2 blocks, then finishes
    scheduler.add_request(ereq("b", 32, max_tokens=1))  # 8 blocks: all that a leaves free
    assert step(scheduler, runner) == [("a", 7, True)]
    # b would take every free block beside a: it waits for a rather than be preempted later.
    assert scheduler.num_waiting == 1
    assert step(scheduler, runner) == [("b", 32, True)]
    assert len(runner.steps[-1].scheduled[0].block_ids) == 8


def test_runner_output_must_match_needs_sample() -> None:
    scheduler, _ = make(max_num_batched_tokens=8)
    scheduler.add_request(ereq("a", 12))
    out = scheduler.schedule()
    assert not out.scheduled[0].needs_sample
    with pytest.raises(ValueError, match="mid-prefill"):
        scheduler.update_from_output(out, RunnerOutput([5]))
    scheduler2, _ = make()
    scheduler2.add_request(ereq("b", 3))
    out = scheduler2.schedule()
    with pytest.raises(ValueError, match="no token"):
        scheduler2.update_from_output(out, RunnerOutput([None]))


def test_prompt_logprobs_bypass_the_prefix_cache() -> None:
    scheduler, runner = make()
    prompt = list(range(700, 713))
    scheduler.add_request(ereq("a", prompt, max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(ereq("b", prompt, max_tokens=1, prompt_logprobs=1))
    (sreq,) = scheduler.schedule().scheduled
    assert (sreq.num_computed_tokens, sreq.num_new_tokens) == (0, 13)
