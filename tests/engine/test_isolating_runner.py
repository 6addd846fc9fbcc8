"""One request's failure inside a step fails that request only.

With the real EngineCore (tiny random model, runner V1 on the CPU) and a custom logits
processor that raises for one request's tokens, which is a failure only that request's data
causes and only the runner sees; and with stand-in runners for the cases that must stay fatal.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput, SchedulerOutput
from davit_engine.core.scheduler import Scheduler
from davit_engine.engine_core import EngineCore
from davit_engine.isolating_runner import MAX_FAILED_STEPS, IsolatingRunner, isolating
from davit_engine.runner.base import ModelRunner
from davit_engine.runner.sampler import unregister_logits_processor
from davit_engine.step_pipeline import StepPipeline
from davit_engine.types import EngineRequest, FinishReason, RequestDelta, SamplingParams

POISON = 77  # a prompt holding this token id three times in a row makes the processor raise
PROCESSOR = f"{__name__}:poisoned_by_token"


def poisoned_by_token(token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    """A deployment's logits processor with a bug that one request's input triggers."""
    ids = list(token_ids)
    if any(ids[i : i + 3] == [POISON] * 3 for i in range(len(ids) - 2)):
        raise ValueError("the processor cannot handle this input")
    return logits


def run_to_end(core: EngineCore) -> dict[str, list[RequestDelta]]:
    deltas: dict[str, list[RequestDelta]] = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCore]:
    config = EngineConfig(
        model="random:qwen3-tiny",
        device="cpu",
        dtype="float32",
        num_gpu_blocks=64,
        logits_processors=(PROCESSOR,),
    )
    try:
        yield EngineCore(config)
    finally:
        unregister_logits_processor(PROCESSOR)


def test_the_failing_request_finishes_with_an_error_and_the_others_run_on(
    core: EngineCore,
) -> None:
    prompts = {f"ok-{i}": [10 + i, 20, 30, 40 + i] for i in range(5)}
    prompts["poisoned"] = [5, POISON, POISON, POISON, 6]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = {}
    for rid, prompt in prompts.items():  # each good request alone: the reference output
        if rid != "poisoned":
            core.add_request(EngineRequest(f"{rid}-alone", prompt, greedy))
            alone[rid] = run_to_end(core)[f"{rid}-alone"]
    for rid, prompt in prompts.items():
        core.add_request(EngineRequest(rid, prompt, greedy))
    together = run_to_end(core)

    failed = together["poisoned"]
    assert [d.finish_reason for d in failed] == [FinishReason.ERROR]
    assert failed[0].error == "ValueError" and failed[0].num_prompt_tokens == 5
    for rid, reference in alone.items():
        tokens = [t for d in together[rid] for t in d.new_token_ids]
        assert tokens == [t for d in reference for t in d.new_token_ids]
        assert together[rid][-1].finish_reason is FinishReason.LENGTH
    stats = core.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    core.scheduler.check_invariants()
    # The core still serves.
    core.add_request(EngineRequest("after", [1, 2, 3], greedy))
    assert run_to_end(core)["after"][-1].finish_reason is FinishReason.LENGTH


class _Failing(ModelRunner):
    """Raises on every step that holds one of `bad` (all of them when `bad` is None)."""

    name = "stand-in"
    repeatable_steps = True

    def __init__(self, bad: set[str] | None) -> None:
        self.bad = bad

    def determine_num_blocks(self) -> int:
        return 16

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Nothing to allocate."""

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        if any(self.bad is None or r.request_id in self.bad for r in batch.scheduled):
            raise RuntimeError("device failure")
        return RunnerOutput([1 if r.needs_sample else None for r in batch.scheduled])


class _NotRepeatable(_Failing):
    repeatable_steps = False


def _pipeline(runner: ModelRunner) -> tuple[Scheduler, StepPipeline, IsolatingRunner]:
    scheduler = Scheduler(EngineConfig(model="x", max_num_seqs=8), num_blocks=16, max_model_len=64)
    guard = isolating(runner, scheduler)
    return scheduler, StepPipeline(scheduler, guard, async_scheduling=False), guard


def _add(scheduler: Scheduler, *ids: str) -> None:
    for rid in ids:
        scheduler.add_request(EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=3)))


def test_a_runner_whose_steps_cannot_repeat_still_stops_the_core() -> None:
    scheduler, pipeline, _ = _pipeline(_NotRepeatable({"b"}))
    _add(scheduler, "a", "b")
    with pytest.raises(RuntimeError, match="device failure"):
        pipeline.step()


def test_a_step_where_every_request_fails_is_not_one_requests_failure() -> None:
    scheduler, pipeline, _ = _pipeline(_Failing(None))
    _add(scheduler, "a", "b", "c")
    with pytest.raises(RuntimeError, match="device failure"):
        pipeline.step()


def test_lone_requests_failing_step_after_step_stop_the_core() -> None:
    scheduler, pipeline, guard = _pipeline(_Failing(None))
    for i in range(MAX_FAILED_STEPS - 1):
        _add(scheduler, f"r{i}")
        pipeline.step()
        [failed] = guard.take_failed()
        assert failed.request_id == f"r{i}" and failed.finish_reason is FinishReason.ERROR
    _add(scheduler, "last")
    with pytest.raises(RuntimeError, match="device failure"):
        pipeline.step()
