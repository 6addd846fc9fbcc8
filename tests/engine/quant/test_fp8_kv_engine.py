"""An FP8 KV cache through the whole engine on the CPU (runner V1, FP8 storage, float32
compute): prefix caching and preemption give the tokens an FP8 run gives without them, the
profile counts one byte per element (twice the tokens of bf16 in the same bytes) and names both
dtypes, and where FP8 cannot run the flags are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.engine_core import EngineCore
from davit_engine.llm import LLM
from davit_engine.quant.support import check_fp8_device
from davit_engine.types import ParamError, SamplingParams

MODEL = "random:qwen3-tiny"
BLOCK = 16
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    shared = [(7 * i) % 500 + 3 for i in range(3 * BLOCK)]  # three full blocks in common
    return [shared + [(11 * i + j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(8)]


def _generate(warm_prefix: bool = False, **flags: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(MODEL, device="cpu", dtype="float32", kv_cache_dtype="fp8", block_size=BLOCK,
              max_num_batched_tokens=512, **flags)  # fmt: skip
    if warm_prefix:  # one request first, so the shared blocks are cached when the rest arrive
        llm.generate(_prompts()[:1], GREEDY)
    outputs = llm.generate(_prompts(), GREEDY)
    return [out.token_ids for out in outputs], llm


def test_prefix_caching_and_preemption_keep_fp8_tokens() -> None:
    reference, llm = _generate(num_gpu_blocks=256, enable_prefix_caching=False)
    llm.shutdown()
    cached, llm = _generate(warm_prefix=True, num_gpu_blocks=256, enable_prefix_caching=True)
    assert cached == reference
    assert llm.core.stats().prefix_cache_hits >= 3 * BLOCK  # FP8 blocks were reused
    llm.shutdown()
    at_admission = sum(-(-len(p) // BLOCK) for p in _prompts())
    tight, llm = _generate(num_gpu_blocks=at_admission + 2, enable_prefix_caching=False)
    stats = llm.core.stats()
    assert stats.num_preemptions > 0
    assert tight == reference
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.shutdown()


def test_profile_counts_one_byte_per_element_and_names_both_dtypes() -> None:
    base = EngineConfig(model=MODEL, device="cpu", dtype="bfloat16", max_model_len=256,
                        kv_cache_memory_bytes=8 << 20)  # fmt: skip
    profiles = {}
    for kv in ("auto", "fp8"):
        for quantization in (None, "fp8"):
            core = EngineCore(
                dataclasses.replace(base, kv_cache_dtype=kv, quantization=quantization)
            )
            assert core.memory_profile is not None
            profiles[kv, quantization] = core.memory_profile
            core.shutdown()
    bf16, fp8 = profiles["auto", None], profiles["fp8", None]
    assert fp8.memory.block_bytes * 2 == bf16.memory.block_bytes
    assert fp8.memory.token_capacity == 2 * bf16.memory.token_capacity
    assert (bf16.identity.kv_cache_dtype, bf16.identity.quantization) == ("auto", "none")
    assert (fp8.identity.kv_cache_dtype, fp8.identity.dtype) == ("fp8", "bfloat16")
    assert profiles["fp8", "fp8"].identity.quantization == "fp8"
    assert len({p.identity.hash() for p in profiles.values()}) == 4


def test_fp8_is_refused_on_gpus_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ParamError, match="compute capability 8.9 or newer.*A100.*8.0") as err:
        check_fp8_device(torch.device("cuda", 0), "--kv-cache-dtype", "fp8")
    assert err.value.param == "--kv-cache-dtype" and "remove --kv-cache-dtype" in err.value.message
    # a checkpoint stored in FP8: no flag to remove
    with pytest.raises(ParamError, match="8.0: serve an unquantized checkpoint") as err:
        check_fp8_device(torch.device("cuda", 0), "model", "ckpt: fp8 quantization")
    assert err.value.param == "model"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0), "--quantization", "fp8")  # Hopper: accepted
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(ParamError, match="ROCm") as err:
        check_fp8_device(torch.device("cuda", 0), "--quantization", "fp8")
    assert err.value.param == "--quantization"
    check_fp8_device(torch.device("cpu"), "--quantization", "fp8")  # emulated on the CPU
