"""Speculative decoding in the scheduler and the step pipeline, against the simulated runner.

Greedy verification is lossless: with n-gram drafts (proposed by the scheduler) or draft-model
drafts (proposed by the runner), every request's output must be exactly its output without
speculation, through preemptions, aborts, prefix-cache hits and asynchronous steps; every block
is free at the end; the budget counts K + 1 target tokens per verifying request and at most
`max_num_spec_seqs` verify per step.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from davit_engine.core.scheduler import Scheduler
from davit_engine.spec_decode.config import SpeculativeConfig, with_defaults
from davit_engine.step_pipeline import StepPipeline
from davit_engine.types import EngineRequest, SamplingParams

from .sim import SpecSimRunner, make_config, reference_outputs
from .test_async_scheduling import drive

VOCAB = 5  # tiny: drafts are often right, often wrong
EOS = 7  # outside what the digest draws; emitted every `eos_every`-th digest


def spec_config(method: str = "ngram", k: int = 3, **fields: object) -> SpeculativeConfig:
    if method == "ngram":
        fields.setdefault("prompt_lookup_min", 1)
        fields.setdefault("prompt_lookup_max", 2)
    else:
        fields.setdefault("model", "random:qwen3-tiny")
    config = SpeculativeConfig(method, k, **fields)  # type: ignore[arg-type]
    config.validate()
    return with_defaults(config)


def workload(
    rng: random.Random, num_requests: int, num_steps: int = 30
) -> tuple[dict[int, list[EngineRequest]], dict[str, int]]:
    prefixes = [[rng.randrange(0, VOCAB) for _ in range(20)] for _ in range(3)]
    arrivals: dict[int, list[EngineRequest]] = {}
    abort_at: dict[str, int] = {}
    for i in range(num_requests):
        prompt = rng.choice(prefixes)[: rng.randint(0, 20)]
        prompt += [rng.randrange(0, VOCAB) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, 30),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=(rng.randrange(0, VOCAB),) if rng.random() < 0.3 else (),
            logprobs=1 if rng.random() < 0.1 else None,  # decodes without speculation
        )
        name = f"r{i}"
        arrivals.setdefault(rng.randrange(0, num_steps), []).append(
            EngineRequest(name, prompt, params, eos_token_ids=(EOS,))
        )
        if rng.random() < 0.2:
            abort_at[name] = rng.randint(1, 8)
    return arrivals, abort_at


def make(
    num_blocks: int, method: str, async_scheduling: bool, **config: object
) -> tuple[Scheduler, StepPipeline, SpecSimRunner]:
    cfg = make_config(speculative_config=spec_config(method), **config)
    scheduler = Scheduler(cfg, num_blocks, 96)
    runner = SpecSimRunner(
        num_blocks, cfg.block_size, vocab_size=VOCAB, eos_token_id=EOS, eos_every=13
    )
    pipeline = StepPipeline(scheduler, runner, async_scheduling)  # type: ignore[arg-type]
    return scheduler, pipeline, runner


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(
    ("seed", "num_blocks", "config"),
    [
        (1, 96, {}),
        (2, 20, {"max_num_seqs": 4}),  # small pool: preemptions, some while verifying
        (3, 60, {"max_num_batched_tokens": 9}),  # chunked prefill; few verify per step
        (4, 40, {"enable_prefix_caching": False}),
        (5, 64, {"block_size": 8, "max_num_seqs": 16}),
    ],
)
def test_greedy_speculation_gives_the_outputs_without_it(
    method: str, async_scheduling: bool, seed: int, num_blocks: int, config: dict[str, object]
) -> None:
    arrivals, abort_at = workload(random.Random(seed), 30)
    scheduler, pipeline, runner = make(num_blocks, method, async_scheduling, **config)
    run = drive(scheduler, pipeline, arrivals, abort_at)
    requests = [r for reqs in arrivals.values() for r in reqs]
    expected = reference_outputs(
        requests, scheduler.max_model_len, vocab_size=VOCAB, eos_token_id=EOS, eos_every=13
    )
    for name, tokens in run.outputs.items():
        if name in run.aborted:
            assert tokens == expected[name][: len(tokens)], name
        else:
            assert tokens == expected[name], name
    stats = scheduler.stats()
    assert stats.num_free_blocks == num_blocks
    assert stats.generation_tokens_total >= sum(len(t) for t in run.outputs.values())
    spec = scheduler.spec_stats
    assert spec is not None and runner.num_spec_rows > 0
    assert spec.num_draft_tokens <= runner.num_proposed  # aborted steps are not counted
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert spec.accepted_per_position[0] >= spec.accepted_per_position[-1]
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens


def test_200_requests_with_random_aborts_while_verifying_free_every_block() -> None:
    rng = random.Random(11)
    num_blocks = 48
    scheduler, pipeline, runner = make(num_blocks, "draft_model", True, max_num_seqs=8)
    live: set[str] = set()
    aborted_while_verifying = 0
    for i in range(200):
        prompt = [rng.randrange(0, VOCAB) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 40), ignore_eos=True)
        scheduler.add_request(EngineRequest(f"r{i}", prompt, params))
        live.add(f"r{i}")
        for _ in range(rng.randint(0, 3)):
            for delta in pipeline.step():
                if delta.finish_reason is not None:
                    live.discard(delta.request_id)
            scheduler.check_invariants()
        for name in sorted(live):
            req = scheduler.get_request(name)
            if req is not None and rng.random() < 0.08:
                aborted_while_verifying += req.is_verifying
                assert scheduler.abort(name)
                live.discard(name)
    while scheduler.has_unfinished() or pipeline.has_in_flight:
        pipeline.step()
    scheduler.schedule()  # reports the last finished ids
    scheduler.check_invariants()
    assert scheduler.block_manager.num_free_blocks == num_blocks
    assert aborted_while_verifying > 0
    assert runner.num_spec_rows > 0


def test_budget_counts_k_plus_one_target_tokens_and_caps_verifying_requests() -> None:
    k = 3
    cfg = make_config(
        speculative_config=spec_config("draft_model", k),
        max_num_batched_tokens=10,
        max_num_seqs=8,
    )
    scheduler = Scheduler(cfg, 200, 96)
    assert scheduler.max_num_spec_seqs == 2  # 10 // (K + 1)
    runner = SpecSimRunner(200, cfg.block_size, vocab_size=VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        scheduler.add_request(EngineRequest(f"r{i}", [1, 2], params))
    out = scheduler.schedule()  # four 2-token prefills
    scheduler.update_from_output(out, runner.execute(out))
    out = scheduler.schedule()
    spec = [s for s in out.scheduled if s.num_spec_tokens]
    plain = [s for s in out.scheduled if not s.num_spec_tokens]
    assert [s.num_new_tokens for s in spec] == [k + 1, k + 1]
    assert [s.num_new_tokens for s in plain] == [1, 1]
    assert out.num_batched_tokens == 10
    for s in spec:
        assert len(s.block_ids) * cfg.block_size >= s.num_computed_tokens + k + 1

    # The upstream-style reservation takes max_num_seqs x K budget tokens for drafts: with a
    # budget of 40, 8 x 3 = 24 are reserved, and fewer requests fit the remaining 16.
    reserved = Scheduler(dataclasses.replace(cfg, max_num_batched_tokens=40), 200, 96)
    separate = Scheduler(dataclasses.replace(cfg, max_num_batched_tokens=40), 200, 96)
    reserved.draft_budget = "reserved"
    counts = []
    for sched in (separate, reserved):
        for i in range(8):
            sched.add_request(EngineRequest(f"r{i}", [1, 2], params))
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        out = sched.schedule()
        counts.append(out.num_batched_tokens)
    assert counts == [8 * (k + 1), 16]


def test_without_a_match_nothing_verifies_and_ineligible_requests_stay_asynchronous() -> None:
    cfg = make_config(
        speculative_config=spec_config("ngram", 3, prompt_lookup_min=4, prompt_lookup_max=4)
    )
    for name, params, pending in (
        ("greedy", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), 0),
        ("logprobs", SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1), 1),
    ):
        scheduler = Scheduler(cfg, 64, 96)
        runner = SpecSimRunner(64, cfg.block_size, vocab_size=1000)
        pipeline = StepPipeline(scheduler, runner, async_scheduling=True)  # type: ignore[arg-type]
        scheduler.add_request(EngineRequest(name, list(range(100, 120)), params))
        while scheduler.has_unfinished() or pipeline.has_in_flight:
            pipeline.step()
        assert runner.num_spec_rows == 0
        # A request that may speculate steps synchronously (its drafts need its latest
        # token); one that cannot keeps the one-step-ahead pipeline.
        assert runner.max_pending_seen == pending, name
