"""Speculative decoding on runner V2 through the real scheduler and step pipeline.

Greedy verification is lossless: with n-gram drafts and with a draft model, the outputs are
token for token runner V1's without speculation, on random Qwen3 and Llama shapes (acceptance
near 0 for a different random draft) and on SmolLM2-135M's real weights (the same GGUF as the
draft: acceptance near 100%). CPU: Triton's interpreter, no graphs; GPU: the verification and
draft-proposal graphs too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.core.scheduler import Scheduler
from davit_engine.loader import load_model
from davit_engine.runner.base import ModelRunner
from davit_engine.runner.v1 import RunnerV1
from davit_engine.runner.v2 import RunnerV2
from davit_engine.spec_decode.config import speculative_config_from_json
from davit_engine.step_pipeline import StepPipeline
from davit_engine.types import EngineRequest, ParamError, SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _config(model: str, spec: dict[str, Any] | None = None, **overrides: Any) -> EngineConfig:
    base = EngineConfig(
        model=model,
        dtype="float32",
        device=DEVICE.type,
        num_gpu_blocks=48,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=160,
        speculative_config=speculative_config_from_json(spec) if spec else None,
    )
    return dataclasses.replace(base, **overrides)


def _run(
    runner: ModelRunner,
    config: EngineConfig,
    requests: list[EngineRequest],
    async_scheduling: bool = True,
) -> tuple[dict[str, list[int]], Scheduler]:
    num_blocks = config.num_gpu_blocks or 48
    runner.initialize_kv_cache(num_blocks)
    scheduler = Scheduler(config, num_blocks, config.max_model_len or 160)
    pipeline = StepPipeline(scheduler, runner, async_scheduling and runner.name == "v2")
    for req in requests:
        scheduler.add_request(req)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while scheduler.has_unfinished() or pipeline.has_in_flight:
        for delta in pipeline.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
        scheduler.check_invariants()
    scheduler.schedule()
    assert scheduler.block_manager.num_free_blocks == num_blocks
    return outputs, scheduler


def _repetitive_requests(params: SamplingParams, lengths: list[int]) -> list[EngineRequest]:
    """Prompts that repeat a random phrase: n-gram lookup finds drafts in them."""
    gen = torch.Generator().manual_seed(7)
    phrase = torch.randint(0, 500, (7,), generator=gen).tolist()
    requests = []
    for i, n in enumerate(lengths):
        noise = torch.randint(0, 500, (3,), generator=gen).tolist()
        requests.append(EngineRequest(f"r{i}", (noise + phrase * 8)[:n], params))
    return requests


def _v1_outputs(config: EngineConfig, requests: list[EngineRequest]) -> dict[str, list[int]]:
    plain = dataclasses.replace(config, speculative_config=None)
    runner = RunnerV1(plain, load_model(plain, DEVICE), DEVICE)
    return _run(runner, plain, requests)[0]


GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("shape", ["qwen3-tiny", "llama-tiny"])
def test_ngram_greedy_matches_plain_decoding_on_random_shapes(shape: str) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    config = _config(f"random:{shape}", spec)
    requests = _repetitive_requests(GREEDY, [9, 30, 17, 40, 12])  # 5 requests, 4 slots
    expected = _v1_outputs(config, requests)
    runner = RunnerV2(config, load_model(config, DEVICE), DEVICE)
    outputs, scheduler = _run(runner, config, requests)
    assert outputs == expected
    stats = scheduler.spec_stats
    assert stats is not None and stats.num_drafts > 0 and runner.spec is not None
    assert runner.spec.num_verify_steps > 0


def test_draft_model_greedy_matches_plain_decoding_with_a_different_random_draft() -> None:
    """A Qwen3 target with a random Llama-shaped draft of the same vocabulary: almost nothing
    is accepted, and the outputs are still exactly the target's."""
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": "random:llama-tiny"}
    config = _config("random:qwen3-tiny", spec, num_gpu_blocks=64)
    requests = _repetitive_requests(GREEDY, [9, 26, 17])
    expected = _v1_outputs(config, requests)
    runner = RunnerV2(config, load_model(config, DEVICE), DEVICE)
    assert runner.draft is not None
    assert runner.block_bytes > RunnerV1(config, load_model(config, DEVICE), DEVICE).block_bytes
    outputs, scheduler = _run(runner, config, requests)
    assert outputs == expected
    stats = scheduler.spec_stats
    assert stats is not None and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens / 2


def test_a_draft_model_identical_to_the_target_is_always_accepted() -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": "random:qwen3-tiny"}
    config = _config("random:qwen3-tiny", spec, seed=3)
    requests = _repetitive_requests(GREEDY, [11, 5])
    runner = RunnerV2(config, load_model(config, DEVICE), DEVICE)
    outputs, scheduler = _run(runner, config, requests)
    assert outputs == _v1_outputs(config, requests)
    stats = scheduler.spec_stats
    assert stats is not None and stats.num_drafts > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # same weights: all accepted


def test_seeded_sampling_with_speculation_is_reproducible_and_batch_independent() -> None:
    # A draft model always proposes (n-gram drafts of sampled random text may never match).
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": "random:qwen3-tiny"}
    config = _config("random:qwen3-tiny", spec)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=42, ignore_eos=True)
    requests = _repetitive_requests(params, [20, 31, 14])
    loaded = load_model(config, DEVICE)
    together, scheduler = _run(RunnerV2(config, loaded, DEVICE), config, requests)
    again, _ = _run(RunnerV2(config, loaded, DEVICE), config, requests)
    alone, _ = _run(RunnerV2(config, loaded, DEVICE), config, requests[1:2])
    assert together == again
    assert together["r1"] == alone["r1"]
    stats = scheduler.spec_stats
    assert stats is not None and stats.num_drafts > 0
    # The draft is the target's argmax: sampled verification accepts some and rejects some.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_synthetic_acceptance_accepts_as_configured_and_is_lossy() -> None:
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": 4,
    }
    config = _config("random:qwen3-tiny", spec)
    assert config.speculative_config is not None and config.speculative_config.is_lossy
    runner = RunnerV2(config, load_model(config, DEVICE), DEVICE)
    _, scheduler = _run(runner, config, _repetitive_requests(GREEDY, [20, 25]))
    stats = scheduler.spec_stats
    assert stats is not None and stats.num_drafts > 0
    # Length K + 1: every real draft is accepted, whatever the target says.
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_draft_model_with_another_vocabulary_is_refused_naming_the_flag() -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": "random:qwen3-tiny"}
    config = _config("random:smollm2-135m", spec)
    with pytest.raises(ParamError) as err:
        RunnerV2(config, load_model(config, DEVICE), DEVICE)
    assert err.value.param == "--speculative-config" and "vocabulary" in err.value.message


@pytest.mark.slow
def test_smollm2_greedy_with_ngram_and_its_own_draft_matches_plain_decoding(
    smollm2_gguf: Any,
) -> None:
    """Real weights: n-gram drafts, and the same GGUF as its own draft model (acceptance near
    100%), give runner V1's greedy tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    text = (
        "Copy this line exactly: the quick brown fox jumps over the lazy dog. The quick brown fox"
    )
    prompt = tokenizer(text)["input_ids"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest("a", prompt, params)]
    model = str(smollm2_gguf)
    base = _config(model, None, block_size=16, max_num_batched_tokens=128, max_model_len=256)
    expected = _v1_outputs(base, requests)
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": model},
    ):
        config = dataclasses.replace(base, speculative_config=speculative_config_from_json(spec))
        runner = RunnerV2(config, load_model(config, DEVICE), DEVICE)
        outputs, scheduler = _run(runner, config, requests)
        assert outputs == expected, spec["method"]
        stats = scheduler.spec_stats
        assert stats is not None and stats.num_accepted_tokens > 0
        if spec["method"] == "draft_model":
            assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens


def test_the_memory_profile_counts_the_draft_models_weights_and_kv() -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": "random:llama-tiny"}
    config = _config("random:qwen3-tiny", spec)
    runner = RunnerV2(config, load_model(config, DEVICE), DEVICE)
    plain = RunnerV2(
        dataclasses.replace(config, speculative_config=None), load_model(config, DEVICE), DEVICE
    )
    assert runner.draft is not None
    runner.determine_num_blocks()
    plain.determine_num_blocks()
    assert runner.memory_profile is not None and plain.memory_profile is not None
    memory, plain_memory = runner.memory_profile.memory, plain.memory_profile.memory
    draft_params = sum(p.numel() * p.element_size() for p in runner.draft.model.parameters())
    assert memory.weights_bytes >= plain_memory.weights_bytes + draft_params
    assert memory.block_bytes == plain_memory.block_bytes + runner.draft.block_bytes


def test_aborts_while_verifying_free_every_block_with_the_real_runner() -> None:
    """Requests aborted while their verification step is in flight (async pipeline): the
    others still get runner V1's tokens, and every block is free at the end."""
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": "random:qwen3-tiny"}
    config = _config("random:qwen3-tiny", spec, num_gpu_blocks=40)
    requests = _repetitive_requests(GREEDY, [9, 21, 14, 30, 6, 17])
    expected = _v1_outputs(config, requests)
    runner = RunnerV2(config, load_model(config, DEVICE), DEVICE)
    runner.initialize_kv_cache(40)
    scheduler = Scheduler(config, 40, 160)
    pipeline = StepPipeline(scheduler, runner, True)
    for req in requests:
        scheduler.add_request(req)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    aborted: set[str] = set()
    num_steps = 0
    while scheduler.has_unfinished() or pipeline.has_in_flight:
        for delta in pipeline.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
        num_steps += 1
        for name in ("r1", "r4"):
            req = scheduler.get_request(name)
            if req is not None and req.is_verifying and num_steps > 3:
                assert scheduler.abort(name)
                aborted.add(name)
        scheduler.check_invariants()
    scheduler.schedule()
    assert aborted == {"r1", "r4"}
    assert scheduler.block_manager.num_free_blocks == 40
    for name, tokens in outputs.items():
        if name in aborted:
            assert tokens == expected[name][: len(tokens)]
        else:
            assert tokens == expected[name]


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": "random:qwen3-tiny"},
    ],
    ids=["ngram", "draft_model"],
)
def test_speculative_greedy_with_an_fp8_kv_cache_matches_plain_decoding(
    spec: dict[str, Any],
) -> None:
    """With an FP8 KV cache speculative decoding still gives exactly the tokens of plain
    decoding over an FP8 cache, and drafts are accepted. A draft model keeps its own cache in
    the model dtype (its bytes are counted as such)."""
    config = _config("random:qwen3-tiny", spec, kv_cache_dtype="fp8", seed=3)
    requests = _repetitive_requests(GREEDY, [9, 30, 17, 40, 12])
    expected = _v1_outputs(config, requests)
    runner = RunnerV2(config, load_model(config, DEVICE), DEVICE)
    outputs, scheduler = _run(runner, config, requests)
    assert outputs == expected
    assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    if runner.draft is not None:
        assert runner.draft.kv_caches[0].dtype == torch.float32
    stats = scheduler.spec_stats
    assert stats is not None and stats.num_accepted_tokens > 0


def test_speculative_greedy_with_fp8_weights_matches_plain_decoding_at_one_product_path() -> None:
    """FP8 weights: the product is weight-only up to 16 rows and quantizes the activations per
    token beyond (docs/fp8.md), so a token's logits depend on how many rows its step had. With
    every step at most 16 rows (the token budget) both runs take the weight-only path, and a
    draft model gives exactly the tokens of plain decoding."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": "random:qwen3-tiny"}
    config = _config("random:qwen3-tiny", spec, quantization="fp8", kv_cache_dtype="fp8",
                     seed=3, max_num_batched_tokens=16)  # fmt: skip
    requests = _repetitive_requests(GREEDY, [9, 30, 17, 40, 12])
    expected = _v1_outputs(config, requests)
    runner = RunnerV2(config, load_model(config, DEVICE), DEVICE)
    assert runner.draft is not None
    assert type(runner.draft.model.model.layers[0].mlp.gate_up_proj).__name__ == "Fp8Linear"
    outputs, scheduler = _run(runner, config, requests)
    assert outputs == expected
    stats = scheduler.spec_stats
    assert stats is not None and stats.num_accepted_tokens > 0
