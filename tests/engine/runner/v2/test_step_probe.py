"""The activation probe of runner V2: real steps through `execute_async` against a probe KV
cache, on a tiny random Qwen3 in fp32 (CPU: Triton's interpreter and the resident set; GPU:
reserved memory), and the profile's activation peak as the larger of the two measurements."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.core.batch import SchedulerOutput
from davit_engine.core.scheduler import Scheduler
from davit_engine.loader import load_model
from davit_engine.memory.profiler import PeakWindow
from davit_engine.runner.paged_kv import PROBE_TOP_K, PROBE_TOP_P
from davit_engine.runner.v2 import RunnerV2, step_probe
from davit_engine.runner.v2.pending import PendingStep
from davit_engine.runner.v2.step_probe import plan_probe_requests
from davit_engine.types import EngineRequest, SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _config(**overrides: object) -> EngineConfig:
    base = EngineConfig(
        model="random:qwen3-tiny",
        dtype="float32",
        device=DEVICE.type,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        enforce_eager=True,  # the graph probe has its own test on the GPU
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


class StepLog:
    """Wraps a runner's `execute_async` and records every step it is given."""

    def __init__(self, runner: RunnerV2, during: Callable[[int], None] | None = None) -> None:
        self.batches: list[SchedulerOutput] = []
        self.sampled: list[int] = []
        self._execute = runner.execute_async
        self._during = during
        runner.execute_async = self  # type: ignore[method-assign]

    def __call__(self, batch: SchedulerOutput) -> PendingStep:
        pending = self._execute(batch)
        self.batches.append(batch)
        result = pending.result()
        self.sampled.append(sum(t is not None for t in result.sampled_token_ids))
        if self._during is not None:
            self._during(len(self.batches))
        return pending

    @property
    def tokens(self) -> list[int]:
        return [b.num_batched_tokens for b in self.batches]


def _runner(config: EngineConfig) -> RunnerV2:
    return RunnerV2(config, load_model(config, DEVICE), DEVICE)


def test_probe_steps_run_through_the_runner_at_the_limits() -> None:
    config = _config()
    runner = _runner(config)
    log = StepLog(runner)
    num_blocks = runner.determine_num_blocks()

    # A full prefill chunk; then its last chunk beside 3 one-token prompts (16 tokens, 4 rows
    # sampled); then a decode of all 4 rows.
    assert log.tokens == [16, 16, 4]
    assert [len(b.scheduled) for b in log.batches] == [1, 4, 4]
    assert log.sampled == [0, 4, 4]
    for batch in log.batches:
        for req in batch.scheduled:
            p = req.sampling
            assert (p.temperature, p.top_k, p.top_p) == (1.0, PROBE_TOP_K, PROBE_TOP_P)
            assert p.logprobs == config.max_logprobs
    probe = runner.step_probe
    assert probe is not None
    assert probe.tokens_per_step == (16, 16, 4) and probe.sampled_per_step == (0, 4, 4)
    # The probe cache holds the requests and one full-length sequence.
    assert probe.num_blocks >= -(-64 // 8)
    profile = runner.memory_profile
    assert profile is not None
    assert profile.memory.activation_peak_bytes >= probe.peak_bytes
    # Nothing of the probe is left, and the runner serves a real cache afterwards.
    assert runner.state is None and runner.kv_caches == [] and runner.num_blocks == 0
    num_blocks = min(num_blocks, 64)  # a GPU's profile sizes a cache of millions of blocks
    runner.initialize_kv_cache(num_blocks)
    scheduler = Scheduler(config, num_blocks, 64)
    scheduler.add_request(
        EngineRequest("r0", list(range(20)), SamplingParams(max_tokens=3, ignore_eos=True))
    )
    outputs: list[int] = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        for delta in scheduler.update_from_output(batch, runner.execute(batch)):
            outputs.extend(delta.new_token_ids)
    assert len(outputs) == 3


class _HeldWindow(PeakWindow):
    """The CPU measurement plus what the test itself held: in a long-lived test process the
    resident set need not grow for a fresh allocation (its pages may come from memory the
    process already holds), so on the CPU the held bytes are reported beside the resident set."""

    held_bytes = 0

    def peak_bytes(self) -> int:
        return max(super().peak_bytes(), _HeldWindow.held_bytes)


def test_profile_takes_the_larger_activation_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step that needs more than the dummy forward (here: 64 MiB held while the second
    probe step runs) sets the profile's activation peak; without it the dummy forward's larger
    figure stays."""
    held: list[torch.Tensor] = []
    extra = 64 << 20
    if DEVICE.type == "cpu":
        monkeypatch.setattr(step_probe, "PeakWindow", _HeldWindow)
        _HeldWindow.held_bytes = 0

    def allocate(step: int) -> None:
        if step == 2:
            held.append(torch.ones(extra // 4, dtype=torch.float32, device=DEVICE))
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            else:
                _HeldWindow.held_bytes = extra
            held.clear()

    config = _config()
    big = _runner(config)
    StepLog(big, during=allocate)
    big.determine_num_blocks()
    assert big.step_probe is not None and big.memory_profile is not None
    # (the resident set may already hold a few of the pages the allocation reuses)
    assert big.step_probe.peak_bytes >= 0.9 * extra
    assert big.memory_profile.memory.activation_peak_bytes == big.step_probe.peak_bytes

    _HeldWindow.held_bytes = 0
    plain = _runner(config)
    plain.determine_num_blocks()
    assert plain.step_probe is not None and plain.memory_profile is not None
    assert plain.step_probe.peak_bytes < extra
    activation = plain.memory_profile.memory.activation_peak_bytes
    assert plain.step_probe.peak_bytes <= activation < big.step_probe.peak_bytes


@pytest.mark.parametrize(
    ("overrides", "tokens", "sampled"),
    [
        # fewer tokens per step than sequences: the mixed step samples 3 rows, the fourth
        # request runs after the first three finish
        ({"max_num_batched_tokens": 3}, [3, 3, 3, 1, 1], [0, 3, 3, 1, 1]),
        # a short context: the long prompt is cut to 18 tokens, leaving two output tokens
        ({"max_model_len": 20}, [16, 2 + 3, 4], [0, 4, 4]),
        # no chunked prefill: request 0 (14 tokens) is prefilled whole beside two others
        ({"enable_chunked_prefill": False, "max_model_len": 16}, [16, 4, 1], [3, 4, 1]),
    ],
)
def test_probe_steps_stay_valid_at_other_limits(
    overrides: dict[str, Any], tokens: list[int], sampled: list[int]
) -> None:
    config = _config(**overrides)
    runner = _runner(config)
    log = StepLog(runner)
    runner.determine_num_blocks()
    assert log.tokens == tokens
    assert log.sampled == sampled
    assert max(log.tokens) <= config.max_num_batched_tokens


def test_probe_plan_at_the_production_limits() -> None:
    plan = plan_probe_requests(256, 2048, 8192, 16)
    # 2048 + (2048 - 255): one full chunk, then the rest beside 255 one-token prompts
    assert plan.prompt_lens == (3841, *([1] * 255))
    assert plan.num_blocks >= 8192 // 16
    needed = -(-3843 // 16) + 255
    assert plan.num_blocks >= needed
    short = plan_probe_requests(8, 4096, 100, 16)
    assert max(short.prompt_lens) == 98  # two output tokens still fit in 100
