"""Randomized invariant tests: many add/abort/step cycles against the simulated runner.

Seeded, so a failure reproduces. Prompts are drawn from a few shared prefixes so the prefix
cache hits and evicts, pools are small so preemption happens, and the simulated runner checks
every KV read against the request's own prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from davit_engine.core.scheduler import QueueFullError, Scheduler
from davit_engine.types import EngineRequest, FinishReason, ParamError, SamplingParams

from .sim import SimRunner, make_config, reference_outputs

EOS = 3


@dataclass(frozen=True)
class Case:
    seed: int
    num_blocks: int
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 48
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_queue_len: int | None = None
    max_model_len: int = 96


CASES = [
    Case(seed=1, num_blocks=24),
    Case(seed=2, num_blocks=12, max_num_seqs=4),
    Case(seed=3, num_blocks=40, max_num_batched_tokens=16),
    Case(seed=4, num_blocks=24, enable_prefix_caching=False),
    Case(seed=5, num_blocks=30, enable_chunked_prefill=False, max_num_batched_tokens=96),
    Case(seed=6, num_blocks=16, max_queue_len=2, max_num_seqs=3),
    Case(seed=7, num_blocks=64, block_size=8, max_num_seqs=16, max_model_len=200),
    Case(seed=8, num_blocks=10, max_num_seqs=2, max_num_batched_tokens=7),
]


def random_request(rng: random.Random, name: str, prefixes: list[list[int]]) -> EngineRequest:
    prefix = rng.choice(prefixes)[: rng.randint(0, 24)]
    suffix = [rng.randrange(10, 1000) for _ in range(rng.randint(1, 20))]
    params = SamplingParams(
        max_tokens=rng.randint(1, 30),
        min_tokens=rng.choice([0, 0, 2]),
        ignore_eos=rng.random() < 0.2,
        stop_token_ids=(rng.randrange(10, 1000),) if rng.random() < 0.2 else (),
        logprobs=1 if rng.random() < 0.2 else None,
    )
    return EngineRequest(name, prefix + suffix, params, eos_token_ids=(EOS,))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c.seed}")
def test_random_add_abort_step_cycles(case: Case) -> None:
    rng = random.Random(case.seed)
    config = make_config(
        block_size=case.block_size,
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        enable_prefix_caching=case.enable_prefix_caching,
        enable_chunked_prefill=case.enable_chunked_prefill,
        max_queue_len=case.max_queue_len,
    )
    scheduler = Scheduler(config, case.num_blocks, case.max_model_len)
    runner = SimRunner(case.num_blocks, case.block_size, eos_token_id=EOS, eos_every=23)
    prefixes = [[rng.randrange(10, 1000) for _ in range(24)] for _ in range(3)]

    accepted: dict[str, EngineRequest] = {}
    outputs: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    aborted: set[str] = set()
    reported_finished: set[str] = set()
    counter = 0

    def one_step() -> None:
        out = scheduler.schedule()
        assert out.num_batched_tokens <= case.max_num_batched_tokens
        assert len(out.scheduled) <= case.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        reported_finished.update(out.finished_ids)
        deltas = scheduler.update_from_output(out, runner.execute(out))
        for delta in deltas:
            assert delta.request_id not in finish, "a delta after the request finished"
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            req_params = accepted[delta.request_id].sampling
            assert (delta.logprobs is not None) == (req_params.logprobs is not None)
            if delta.finish_reason is not None:
                finish[delta.request_id] = delta.finish_reason
        scheduler.check_invariants()

    for _ in range(400):
        action = rng.random()
        if action < 0.35:
            counter += 1
            name = f"r{counter}"
            req = random_request(rng, name, prefixes)
            try:
                scheduler.add_request(req)
            except QueueFullError:
                assert case.max_queue_len is not None
                continue
            except ParamError as err:
                assert err.param == "prompt"
                assert len(req.prompt_token_ids) + 1 > scheduler.max_model_len
                continue
            accepted[name] = req
        elif action < 0.42 and accepted:
            name = rng.choice(sorted(accepted))
            live = scheduler.get_request(name) is not None
            assert scheduler.abort(name) == live
            if live:
                aborted.add(name)
        else:
            one_step()
        scheduler.check_invariants()

    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        one_step()
    assert not scheduler.has_unfinished()
    reported_finished.update(scheduler.schedule().finished_ids)

    # Every accepted request ended: finished with a reason, or aborted. None was dropped.
    assert set(finish) | aborted == set(accepted)
    assert not set(finish) & aborted
    assert reported_finished == set(accepted)
    # Batching, chunking, preemption and prefix hits never change a request's tokens.
    expected = reference_outputs(
        list(accepted.values()), scheduler.max_model_len, eos_token_id=EOS, eos_every=23
    )
    for name, tokens in outputs.items():
        if name in aborted:
            assert tokens == expected[name][: len(tokens)]
        else:
            assert tokens == expected[name], name
    for name in set(accepted) - aborted - set(outputs):
        raise AssertionError(f"{name} finished without output")

    stats = scheduler.stats()
    assert stats.num_free_blocks == case.num_blocks and stats.kv_cache_usage == 0.0
    assert stats.generation_tokens_total == sum(len(t) for t in outputs.values())
    scheduler.block_manager.check_invariants([])
    if case.enable_prefix_caching:
        assert stats.prefix_cache_hits > 0
