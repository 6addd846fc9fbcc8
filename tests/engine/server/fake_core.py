"""A fast stand-in for `davit_engine.engine_core.EngineCore` for the front end's unit tests.

It implements exactly the EngineCore surface the core process drives (`model_info`,
`add_request`, `abort_requests`, `step`, `has_unfinished_requests`, `stats`, `shutdown`) around
the REAL scheduler, block manager, step pipeline and failure isolation, so admission control,
queue limits, aborts freeing blocks, prefix-cache counters and per-request failures behave as
in the engine. Only the model is replaced: the runner spells out a fixed text as byte tokens
(the byte tokenizer's ids), so responses are predictable, and each step sleeps
`DAVIT_FAKE_STEP_S` seconds (default 0.01) to give tests a window for disconnects, overload and
drain.

A prompt containing the byte string "CRASH" makes every runner step that includes it raise
(one request's failure, which the engine isolates); one containing "FATAL" makes the core's
next `step()` raise (a dying core).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput, SchedulerOutput
from davit_engine.core.scheduler import Scheduler
from davit_engine.isolating_runner import isolating
from davit_engine.runner.base import ModelRunner
from davit_engine.step_pipeline import StepPipeline
from davit_engine.types import EngineRequest, EngineStats, ParamError, RequestDelta, TokenLogprob

SCRIPT = "The quick brown fox jumps over the lazy dog. "
EOS_TOKEN_ID = 257
VOCAB_SIZE = 512
NUM_BLOCKS = 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256


@dataclass(frozen=True)
class FakeModelInfo:
    served_model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    runner: str
    runner_reason: str


def script_token(position: int, seed: int | None) -> int:
    """The byte at `position` of the script; a seed shifts where the script starts."""
    offset = 0 if seed is None else seed % len(SCRIPT)
    return SCRIPT.encode()[(position + offset) % len(SCRIPT)]


def _prompt_bytes(token_ids: list[int], num_prompt_tokens: int) -> bytes:
    return bytes(t for t in token_ids[:num_prompt_tokens] if t < 256)


class FakeRunner(ModelRunner):
    """Spells out SCRIPT; keeps no per-request state, so its steps can run again."""

    name = "fake"
    repeatable_steps = True

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def determine_num_blocks(self) -> int:
        return NUM_BLOCKS

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """No cache: the fake model computes nothing."""

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        time.sleep(self.step_s)
        sampled: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        for sreq in batch.scheduled:
            if b"CRASH" in _prompt_bytes(sreq.token_ids, sreq.num_prompt_tokens):
                raise RuntimeError("the fake model failed on one request")
            if not sreq.needs_sample:
                sampled.append(None)
                logprobs.append(None)
                continue
            token = script_token(sreq.num_output_tokens, sreq.sampling.seed)
            sampled.append(token)
            n = sreq.sampling.logprobs
            if n is None:
                logprobs.append(None)
            else:
                top = [(token, -0.25), (token + 1, -1.5), (token + 2, -2.5)][:n]
                logprobs.append(TokenLogprob(token, -0.25, top))
        return RunnerOutput(sampled, logprobs)


class FakeEngineCore:
    def __init__(self, config: EngineConfig) -> None:
        step_s = float(os.environ.get("DAVIT_FAKE_STEP_S", "0.01"))
        max_model_len = min(config.max_model_len or MAX_MODEL_LEN, MAX_MODEL_LEN)
        self.scheduler = Scheduler(config, num_blocks=NUM_BLOCKS, max_model_len=max_model_len)
        self.isolation = isolating(FakeRunner(step_s), self.scheduler)
        self.pipeline = StepPipeline(self.scheduler, self.isolation, async_scheduling=False)
        self._fatal = False
        self.model_info = FakeModelInfo(
            served_model_name=config.model_name,
            max_model_len=self.scheduler.max_model_len,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=(EOS_TOKEN_ID,),
            num_blocks=NUM_BLOCKS,
            block_size=config.block_size,
            dtype="float32",
            device="cpu",
            runner="fake",
            runner_reason="unit tests of the HTTP front end",
        )

    def add_request(self, request: EngineRequest) -> None:
        request.sampling.validate()
        self.scheduler.add_request(request)
        prompt = request.prompt_token_ids
        self._fatal |= b"FATAL" in _prompt_bytes(prompt, len(prompt))

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.pipeline.has_in_flight

    def step(self) -> list[RequestDelta]:
        if self._fatal:
            raise RuntimeError(
                "the fake engine core failed on purpose, in /opt/davit/fake_core.py line 1"
            )
        deltas = self.pipeline.step()
        deltas.extend(self.isolation.take_failed())
        return deltas

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Nothing to release: the fake holds no device memory."""


def failing_core(config: EngineConfig) -> FakeEngineCore:
    """A core factory that refuses the configuration, as EngineCore does for a bad flag."""
    raise ParamError("--max-model-len", f"{config.max_model_len} exceeds the model's 8 positions")
