"""The GPU check's workload, run on the CPU: all requests end together and fill the KV cache."""

from __future__ import annotations

import time

from davit_engine.config import EngineConfig
from davit_engine.engine_core import EngineCore
from davit_tools.bench.memory_check import _fill_workload, plan_lengths


def test_plan_lengths_keep_every_request_at_the_same_total() -> None:
    prompts, outputs = plan_lengths(32, 900, 256, tail=4)
    assert all(p + o == 900 for p, o in zip(prompts, outputs, strict=True))
    # Earlier requests get longer outputs: they are admitted first and must still be running.
    assert outputs == sorted(outputs, reverse=True) and outputs[-1] == 4


def test_fill_workload_reaches_full_batch_and_fills_the_cache() -> None:
    core = EngineCore(
        EngineConfig(
            model="random:qwen3-tiny",
            dtype="float32",
            max_num_seqs=16,
            max_num_batched_tokens=256,
            num_gpu_blocks=1000,
            enable_prefix_caching=False,
            max_model_len=1024,
        )
    )
    result = _fill_workload(core, 4, time.perf_counter() + 300)
    assert result["max_running"] == 16
    assert result["preemptions"] == 0
    assert result["kv_fill"] > 0.95
