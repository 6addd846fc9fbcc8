"""Asynchronous scheduling in the scheduler and the step pipeline, against the simulated runners.

The next step is scheduled before the previous step's tokens are applied; the outputs must be
exactly those of synchronous steps, whatever stops one step late, is preempted or aborted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from davit_engine.core.request import RequestStatus
from davit_engine.core.scheduler import Scheduler
from davit_engine.step_pipeline import StepPipeline
from davit_engine.types import EngineRequest, FinishReason, SamplingParams

from .sim import AsyncSimRunner, SimRunner, make_config, reference_outputs

EOS = 3
VOCAB = 60  # small, so that random stop token ids are actually drawn


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    stop_ids: dict[str, int | None] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    num_steps: int = 0


def drive(
    scheduler: Scheduler,
    pipeline: StepPipeline,
    arrivals: dict[int, list[EngineRequest]],
    abort_at: dict[str, int],
) -> Run:
    """Add requests at given step numbers; abort a request once it received `abort_at` tokens
    (the same point in its output whatever the step timing)."""
    run = Run()
    arrivals = {k: list(v) for k, v in arrivals.items()}
    while arrivals or scheduler.has_unfinished() or pipeline.has_in_flight:
        for req in arrivals.pop(run.num_steps, []):
            scheduler.add_request(req)
            run.outputs[req.request_id] = []
        for delta in pipeline.step():
            name = delta.request_id
            assert name not in run.finish and name not in run.aborted, "delta after the end"
            run.outputs[name].extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                run.finish[name] = delta.finish_reason
                run.stop_ids[name] = delta.stop_token_id
        for name, count in abort_at.items():
            live = scheduler.get_request(name) is not None
            if live and len(run.outputs[name]) >= count:
                assert scheduler.abort(name)
                run.aborted.add(name)
        scheduler.check_invariants()
        run.num_steps += 1
        assert run.num_steps < 5_000, "no progress"
    return run


def pipeline_pair(
    num_blocks: int, max_model_len: int, **config: object
) -> tuple[tuple[Scheduler, StepPipeline], tuple[Scheduler, StepPipeline, AsyncSimRunner]]:
    cfg = make_config(**config)
    bs = cfg.block_size
    sync_sched = Scheduler(cfg, num_blocks, max_model_len)
    sync_runner = SimRunner(num_blocks, bs, vocab_size=VOCAB, eos_token_id=EOS, eos_every=11)
    async_sched = Scheduler(cfg, num_blocks, max_model_len)
    async_runner = AsyncSimRunner(num_blocks, bs, vocab_size=VOCAB, eos_token_id=EOS, eos_every=11)
    return (
        (sync_sched, StepPipeline(sync_sched, sync_runner, async_scheduling=False)),  # type: ignore[arg-type]
        (
            async_sched,
            StepPipeline(async_sched, async_runner, async_scheduling=True),  # type: ignore[arg-type]
            async_runner,
        ),
    )


def random_workload(
    rng: random.Random, num_requests: int
) -> tuple[dict[int, list[EngineRequest]], dict[str, int]]:
    prefixes = [[rng.randrange(10, 1000) for _ in range(20)] for _ in range(3)]
    arrivals: dict[int, list[EngineRequest]] = {}
    abort_at: dict[str, int] = {}
    for i in range(num_requests):
        prompt = rng.choice(prefixes)[: rng.randint(0, 20)]
        prompt += [rng.randrange(10, 1000) for _ in range(rng.randint(1, 16))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            min_tokens=rng.choice([0, 0, 3]),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=(rng.randrange(10, VOCAB),) if rng.random() < 0.5 else (),
        )
        name = f"r{i}"
        arrivals.setdefault(rng.randrange(0, 30), []).append(
            EngineRequest(name, prompt, params, eos_token_ids=(EOS,))
        )
        if rng.random() < 0.15:
            abort_at[name] = rng.randint(1, 6)
    return arrivals, abort_at


@pytest.mark.parametrize(
    ("seed", "num_blocks", "config"),
    [
        (1, 64, {}),
        (2, 14, {"max_num_seqs": 4}),  # small pool: preemptions
        (3, 40, {"max_num_batched_tokens": 9}),  # chunked prefill
        (4, 24, {"enable_prefix_caching": False}),
        (5, 12, {"max_num_seqs": 3, "max_num_batched_tokens": 6}),
        (6, 48, {"block_size": 8, "max_num_seqs": 16}),
    ],
)
def test_async_steps_give_the_synchronous_outputs(
    seed: int, num_blocks: int, config: dict[str, object]
) -> None:
    arrivals, abort_at = random_workload(random.Random(seed), 30)
    max_model_len = 64
    (s_sched, s_pipe), (a_sched, a_pipe, a_runner) = pipeline_pair(
        num_blocks, max_model_len, **config
    )
    sync = drive(s_sched, s_pipe, arrivals, abort_at)
    async_ = drive(a_sched, a_pipe, arrivals, abort_at)

    assert a_runner.max_pending_seen == 1, "no step was ever scheduled ahead"
    assert async_.outputs == sync.outputs
    assert async_.finish == sync.finish
    assert async_.stop_ids == sync.stop_ids
    assert async_.aborted == sync.aborted
    # And both are what each request gives alone (so neither has a shared bug).
    requests = [r for reqs in arrivals.values() for r in reqs]
    expected = reference_outputs(
        requests, s_sched.max_model_len, vocab_size=VOCAB, eos_token_id=EOS, eos_every=11
    )
    for name, tokens in async_.outputs.items():
        if name in async_.aborted:
            assert tokens == expected[name][: len(tokens)]
        else:
            assert tokens == expected[name], name
    for sched in (s_sched, a_sched):
        stats = sched.stats()
        assert stats.num_free_blocks == num_blocks
        assert stats.generation_tokens_total == sum(len(t) for t in sync.outputs.values())
    if seed in (2, 5):
        assert a_sched.stats().num_preemptions > 0
    # Stops found one step late (EOS and stop token ids) happened in this workload.
    assert any(r == FinishReason.STOP for r in sync.finish.values())


def one_request(name: str, max_tokens: int, **sampling: object) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return EngineRequest(name, list(range(100, 110)), params, eos_token_ids=(EOS,))


def test_a_stop_found_one_step_late_drops_the_extra_token() -> None:
    cfg = make_config()
    scheduler = Scheduler(cfg, 32, 128)
    runner = AsyncSimRunner(32, 4, vocab_size=VOCAB)
    scheduler.add_request(one_request("a", 20))
    out0 = scheduler.schedule()  # prefill, samples output 0
    pending0 = runner.execute_async(out0)
    stop_token = pending0.output.sampled_token_ids[0]
    assert stop_token is not None
    req = scheduler.get_request("a")
    assert req is not None and req.num_pending_tokens == 1
    # Make output 0 a stop token after the fact: the request must finish with it.
    req.stop_token_ids = frozenset({stop_token})
    out1 = scheduler.schedule()  # scheduled ahead: consumes output 0 as a placeholder
    (row,) = out1.scheduled
    assert (row.num_computed_tokens, row.num_new_tokens, row.num_pending_tokens) == (10, 1, 1)
    assert row.needs_sample and req.num_pending_tokens == 2
    pending1 = runner.execute_async(out1)
    deltas = scheduler.update_from_output(out0, pending0.result())
    assert [(d.new_token_ids, d.finish_reason) for d in deltas] == [
        ([stop_token], FinishReason.STOP)
    ]
    assert req.status is RequestStatus.FINISHED
    assert scheduler.stats().num_free_blocks == 32  # blocks freed before step 1 was read
    assert scheduler.update_from_output(out1, pending1.result()) == []  # extra token dropped
    assert req.token_ids[10:] == [stop_token]
    assert scheduler.schedule().finished_ids == ["a"]


def test_max_tokens_is_known_ahead_and_never_over_scheduled() -> None:
    cfg = make_config()
    scheduler = Scheduler(cfg, 32, 128)
    runner = AsyncSimRunner(32, 4, vocab_size=VOCAB)
    pipeline = StepPipeline(scheduler, runner, async_scheduling=True)  # type: ignore[arg-type]
    scheduler.add_request(one_request("a", 3, ignore_eos=True))
    outputs: list[int] = []
    while scheduler.has_unfinished() or pipeline.has_in_flight:
        for delta in pipeline.step():
            outputs.extend(delta.new_token_ids)
    assert len(outputs) == 3
    # prefill + 2 decodes: the step that would draw a 4th token is never launched
    assert sum(len(s.scheduled) for s in runner.steps) == 3


def test_a_request_preempted_with_a_token_in_flight_keeps_that_token() -> None:
    cfg = make_config(max_num_batched_tokens=64)
    scheduler = Scheduler(cfg, 6, 128)  # 6 blocks of 4: a takes 2, b 3, one is left
    runner = AsyncSimRunner(6, 4, vocab_size=VOCAB)
    scheduler.add_request(
        EngineRequest("a", list(range(100, 108)), SamplingParams(max_tokens=8, ignore_eos=True))
    )
    scheduler.add_request(
        EngineRequest("b", list(range(200, 212)), SamplingParams(max_tokens=8, ignore_eos=True))
    )
    out0 = scheduler.schedule()
    assert [s.request_id for s in out0.scheduled] == ["a", "b"]
    pending0 = runner.execute_async(out0)
    out1 = scheduler.schedule()  # a's decode takes the last block; b (newest) is preempted
    assert out1.preempted_ids == ["b"]
    b = scheduler.get_request("b")
    assert b is not None and b.status is RequestStatus.PREEMPTED and b.num_pending_tokens == 1
    pending1 = runner.execute_async(out1)
    deltas = scheduler.update_from_output(out0, pending0.result())
    assert {d.request_id for d in deltas} == {"a", "b"}
    assert b.num_pending_tokens == 0 and b.num_output_tokens == 1
    scheduler.update_from_output(out1, pending1.result())
    scheduler.check_invariants()


def test_a_reused_request_id_does_not_take_the_dropped_token() -> None:
    cfg = make_config()
    scheduler = Scheduler(cfg, 32, 128)
    runner = AsyncSimRunner(32, 4, vocab_size=VOCAB)
    scheduler.add_request(one_request("a", 20, ignore_eos=True))
    out0 = scheduler.schedule()
    pending0 = runner.execute_async(out0)
    out1 = scheduler.schedule()
    pending1 = runner.execute_async(out1)
    scheduler.update_from_output(out0, pending0.result())
    assert scheduler.abort("a")
    scheduler.add_request(one_request("a", 5, ignore_eos=True))  # same id, new request
    assert scheduler.update_from_output(out1, pending1.result()) == []
    fresh = scheduler.get_request("a")
    assert fresh is not None and fresh.num_output_tokens == 0


def test_sync_pipeline_refuses_nothing_and_async_needs_support() -> None:
    cfg = make_config()
    scheduler = Scheduler(cfg, 8, 32)
    with pytest.raises(ValueError, match="does not support asynchronous scheduling"):
        StepPipeline(scheduler, SimRunner(8, 4), async_scheduling=True)  # type: ignore[arg-type]
