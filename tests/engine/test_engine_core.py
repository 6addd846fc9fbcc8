"""EngineCore on a tiny random model on the CPU (runner V1): validation, aborts, KV sizing and
max_model_len."""

from __future__ import annotations

import pytest

from davit_engine.config import EngineConfig
from davit_engine.engine_core import EngineCore
from davit_engine.runner.v1 import CPU_KV_BUDGET_BYTES, RunnerV1
from davit_engine.types import EngineRequest, FinishReason, ParamError, SamplingParams


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(
        EngineConfig(model="random:qwen3-tiny", device="cpu", dtype="float32", num_gpu_blocks=64)
    )


def request(rid: str, prompt: list[int], **params: object) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(**params))  # type: ignore[arg-type]


def run_to_end(core: EngineCore) -> dict[str, list]:
    deltas: dict[str, list] = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def test_model_info(core: EngineCore) -> None:
    info = core.model_info
    assert info.runner == "v1" and info.device == "cpu" and info.dtype == "float32"
    assert info.vocab_size == 512 and info.eos_token_ids == (257,)
    assert info.num_blocks == 64 and info.block_size == 16
    # min(model positions 1024, KV capacity 64 blocks x 16 tokens = 1024).
    assert info.max_model_len == 1024


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (request("a", [1, 2, 600]), "prompt"),
        (request("b", [1, -1]), "prompt"),
        (request("c", []), "prompt"),
        (request("d", [1] * 1024), "prompt"),
        (request("e", [1, 2], temperature=3.0), "temperature"),
        (request("f", [1, 2], max_tokens=0), "max_tokens"),
        (request("g", [1, 2], stop_token_ids=(9999,)), "stop_token_ids"),
        (request("h", [1, 2], logits_processors=("missing",)), "logits_processors"),
        (request("i", [1, 2], logprobs=21), "logprobs"),
        (request("j", [1, 2], prompt_logprobs=1), "prompt_logprobs"),
    ],
)
def test_bad_requests_name_the_field(core: EngineCore, req: EngineRequest, param: str) -> None:
    with pytest.raises(ParamError) as err:
        core.add_request(req)
    assert err.value.param == param
    assert not core.has_unfinished_requests()


def test_generation_and_abort(core: EngineCore) -> None:
    core.add_request(request("keep", [5, 6, 7], max_tokens=5, temperature=0.0, ignore_eos=True))
    core.add_request(request("drop", [5, 6, 8], max_tokens=50, temperature=0.0, ignore_eos=True))
    core.step()
    core.abort_requests(["drop", "unknown-id"])
    deltas = run_to_end(core)
    assert [d.finish_reason for d in deltas["drop"]] == [FinishReason.ABORT]
    kept = deltas["keep"]
    assert sum(len(d.new_token_ids) for d in kept) == 4  # one token came in the first step
    assert kept[-1].finish_reason is FinishReason.LENGTH
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_cpu_kv_budget_and_max_model_len() -> None:
    core = EngineCore(
        EngineConfig(model="random:qwen3-tiny", device="cpu", dtype="float32", max_num_seqs=4)
    )
    runner = core.runner
    assert isinstance(runner, RunnerV1)
    # Enough for 4 sequences of the model's 1024 positions, well under the 2 GiB cap.
    assert core.model_info.num_blocks == 4 * 1024 // 16
    assert core.model_info.num_blocks * runner.block_bytes <= CPU_KV_BUDGET_BYTES
    small = EngineCore(
        EngineConfig(
            model="random:qwen3-tiny",
            device="cpu",
            dtype="float32",
            kv_cache_memory_bytes=10 * runner.block_bytes,
        )
    )
    assert small.model_info.num_blocks == 10
    assert small.model_info.max_model_len == 160  # capped by the KV capacity
    with pytest.raises(ParamError) as err:
        EngineCore(EngineConfig(model="random:qwen3-tiny", device="cpu", max_model_len=5000))
    assert err.value.param == "--max-model-len"
    with pytest.raises(ParamError) as err:
        EngineCore(EngineConfig(model="random:qwen3-tiny", device="cpu", kv_cache_memory_bytes=1))
    assert err.value.param == "--kv-cache-memory-bytes"


def test_runner_v1_steps_synchronously(core: EngineCore) -> None:
    """Asynchronous scheduling is on by default but needs runner V2: V1 stays synchronous."""
    assert core.config.async_scheduling
    assert not core.model_info.async_scheduling and not core.pipeline.async_scheduling
    core.add_request(request("sync", [1, 2, 3], max_tokens=3, temperature=0.0))
    deltas = run_to_end(core)["sync"]
    assert sum(len(d.new_token_ids) for d in deltas) == 3
    assert not core.pipeline.has_in_flight
