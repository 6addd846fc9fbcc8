"""Asynchronous scheduling with the real runner V2: token for token the same as synchronous V2
and as runner V1, on a tiny random Qwen3 in fp32 (CPU: Triton's interpreter; GPU: graphs).

One workload covers chunked prefill, preemption by recompute, prefix-cache hits, EOS and stop
token ids found one step late, max_tokens known ahead, and an abort.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.core.scheduler import Scheduler
from davit_engine.loader import LoadedModel, load_model
from davit_engine.runner.base import ModelRunner
from davit_engine.runner.v1 import RunnerV1
from davit_engine.runner.v2 import RunnerV2
from davit_engine.step_pipeline import StepPipeline
from davit_engine.types import EngineRequest, FinishReason, SamplingParams, TokenLogprob

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _config(**overrides: object) -> EngineConfig:
    base = EngineConfig(
        model="random:qwen3-tiny",
        dtype="float32",
        device=DEVICE.type,
        num_gpu_blocks=10,  # too small for all requests at once: preemptions
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=24,  # prompts are prefilled in chunks
        max_model_len=128,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    stop_ids: dict[str, int | None] = field(default_factory=dict)
    num_preemptions: int = 0
    prefix_cache_hits: int = 0


def _run(
    runner: ModelRunner,
    config: EngineConfig,
    requests: list[EngineRequest],
    async_scheduling: bool,
    abort_at: dict[str, int] | None = None,
) -> Run:
    num_blocks = config.num_gpu_blocks or 64
    runner.initialize_kv_cache(num_blocks)
    scheduler = Scheduler(config, num_blocks, config.max_model_len or 128)
    pipeline = StepPipeline(scheduler, runner, async_scheduling)
    run = Run()
    for req in requests:
        scheduler.add_request(req)
        run.outputs[req.request_id] = []
        run.logprobs[req.request_id] = []
    while scheduler.has_unfinished() or pipeline.has_in_flight:
        for delta in pipeline.step():
            run.outputs[delta.request_id].extend(delta.new_token_ids)
            run.logprobs[delta.request_id].extend(delta.logprobs or [])
            if delta.finish_reason is not None:
                run.finish[delta.request_id] = delta.finish_reason
                run.stop_ids[delta.request_id] = delta.stop_token_id
        for name, count in (abort_at or {}).items():
            if scheduler.get_request(name) is not None and len(run.outputs[name]) >= count:
                scheduler.abort(name)
        scheduler.check_invariants()
    pipeline.step()  # hands the last finished ids to the runner
    stats = scheduler.stats()
    run.num_preemptions = stats.num_preemptions
    run.prefix_cache_hits = stats.prefix_cache_hits
    assert stats.num_free_blocks == num_blocks
    return run


def _first_occurrence(tokens: list[int], start: int) -> int:
    """The first index >= start whose token does not occur earlier (start if none)."""
    return next((i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i]), start)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 512, (16,), generator=gen).tolist()  # two full blocks
    lengths = [30, 7, 20, 12, 26, 9]
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    prompts[0] = shared + prompts[0][:14]  # r0 runs longest and holds the shared blocks
    prompts[5] = shared + prompts[5]
    return prompts


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(_config(), DEVICE)


def test_async_v2_matches_sync_v2_and_v1_greedy(loaded: LoadedModel) -> None:
    config = _config()
    prompts = _prompts()
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = _run(
        RunnerV1(config, load_model(config, DEVICE), DEVICE),
        config,
        [EngineRequest(f"r{i}", p, free) for i, p in enumerate(prompts)],
        async_scheduling=False,
    )
    ref = reference.outputs
    # Stops placed from the free-running outputs at a token's first occurrence, so that they
    # trigger mid-stream at a known index whatever the random model repeats.
    stop1, stop2 = _first_occurrence(ref["r1"], 4), _first_occurrence(ref["r2"], 6)
    requests = [
        EngineRequest("r0", prompts[0], free),
        EngineRequest(
            "r1", prompts[1], dataclasses.replace(free, stop_token_ids=(ref["r1"][stop1],))
        ),
        EngineRequest(
            "r2",
            prompts[2],
            dataclasses.replace(free, ignore_eos=False),
            eos_token_ids=(ref["r2"][stop2],),
        ),
        EngineRequest("r3", prompts[3], dataclasses.replace(free, max_tokens=5)),
        EngineRequest("r4", prompts[4], free),  # aborted after 3 tokens
        EngineRequest("r5", prompts[5], dataclasses.replace(free, max_tokens=1)),
    ]
    abort_at = {"r4": 3}
    v1 = _run(
        RunnerV1(config, load_model(config, DEVICE), DEVICE), config, requests, False, abort_at
    )
    v2_sync = _run(RunnerV2(config, loaded, DEVICE), config, requests, False, abort_at)
    v2_async = _run(RunnerV2(config, loaded, DEVICE), config, requests, True, abort_at)

    for run in (v1, v2_sync, v2_async):
        assert run.num_preemptions > 0 and run.prefix_cache_hits > 0
    assert v2_async.outputs == v2_sync.outputs == v1.outputs
    assert v2_async.finish == v2_sync.finish == v1.finish
    assert v2_async.stop_ids == v2_sync.stop_ids == v1.stop_ids
    out, finish = v2_async.outputs, v2_async.finish
    assert out["r0"] == ref["r0"] and finish["r0"] == FinishReason.LENGTH
    assert out["r1"] == ref["r1"][: stop1 + 1] and finish["r1"] == FinishReason.STOP
    assert v2_async.stop_ids["r1"] == ref["r1"][stop1]
    assert out["r2"] == ref["r2"][: stop2 + 1] and finish["r2"] == FinishReason.STOP
    assert v2_async.stop_ids["r2"] is None  # EOS, not a stop token id
    assert out["r3"] == ref["r3"][:5] and out["r5"] == ref["r5"][:1]
    assert out["r4"] == ref["r4"][:3] and "r4" not in finish


def test_async_v2_matches_sync_v2_seeded_sampling(loaded: LoadedModel) -> None:
    """Seeded temperature sampling with top-p, penalties, min_tokens and logprobs: the draws
    depend on the request's own seed and tokens, so async steps give the same tokens."""
    config = _config(num_gpu_blocks=64)
    params = SamplingParams(
        max_tokens=10,
        temperature=0.8,
        top_p=0.9,
        seed=5,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        min_tokens=6,
        logprobs=2,
        ignore_eos=True,
    )
    requests = [EngineRequest(f"s{i}", p, params) for i, p in enumerate(_prompts()[:4])]
    sync = _run(RunnerV2(config, loaded, DEVICE), config, requests, False)
    async_ = _run(RunnerV2(config, loaded, DEVICE), config, requests, True)
    assert async_.outputs == sync.outputs
    assert all(len(t) == 10 for t in async_.outputs.values())
    for name, lps in async_.logprobs.items():
        assert [lp.token_id for lp in lps] == async_.outputs[name]
        assert [lp.token_id for lp in lps] == [lp.token_id for lp in sync.logprobs[name]]
        for a, b in zip(lps, sync.logprobs[name], strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_min_tokens_counts_the_placeholder(loaded: LoadedModel) -> None:
    """min_tokens masks stop tokens while fewer outputs exist; the token in flight counts as
    one, or async steps would mask them one step too long."""
    config = _config(num_gpu_blocks=64)
    prompt = _prompts()[1]
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (ref,) = _run(
        RunnerV2(config, loaded, DEVICE), config, [EngineRequest("m", prompt, free)], False
    ).outputs.values()
    # A stop token id (masked in the logits while min_tokens holds): the first token from
    # index 2 on that did not occur before; min_tokens lets it end the request exactly there.
    k = _first_occurrence(ref, 2)
    assert ref[k] not in ref[:k], f"the random model repeats {ref}: no fresh token to stop on"
    params = dataclasses.replace(free, stop_token_ids=(ref[k],), min_tokens=k)
    request = EngineRequest("m", prompt, params)
    sync = _run(RunnerV2(config, loaded, DEVICE), config, [request], False)
    async_ = _run(RunnerV2(config, loaded, DEVICE), config, [request], True)
    assert sync.outputs["m"] == ref[: k + 1], (sync.outputs["m"], ref, k) and sync.finish[
        "m"
    ] == FinishReason.STOP
    assert async_.outputs == sync.outputs and async_.finish == sync.finish
