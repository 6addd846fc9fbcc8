"""A fast stand-in for `davit_engine.engine_core.EngineCore` for the front end's unit tests.

It implements exactly the EngineCore surface the core process drives (`model_info`,
`add_request`, `abort_requests`, `step`, `has_unfinished_requests`, `stats`, `shutdown`) around
the REAL scheduler and block manager, so admission control, queue limits, aborts freeing blocks
and prefix-cache counters behave as in the engine. Only the model is replaced: the "runner"
spells out a fixed text as byte tokens (the byte tokenizer's ids), so responses are
predictable, and each step sleeps `DAVIT_FAKE_STEP_S` seconds (default 0.01) to give tests a
window for disconnects, overload and drain.

Prompts containing the byte string "CRASH" make `step()` raise, to test a dying core.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput, SchedulerOutput
from davit_engine.core.scheduler import Scheduler
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


class FakeEngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.step_s = float(os.environ.get("DAVIT_FAKE_STEP_S", "0.01"))
        max_model_len = min(config.max_model_len or MAX_MODEL_LEN, MAX_MODEL_LEN)
        self.scheduler = Scheduler(config, num_blocks=NUM_BLOCKS, max_model_len=max_model_len)
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
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestDelta]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return self.scheduler.update_from_output(out, RunnerOutput([]))
        time.sleep(self.step_s)
        return self.scheduler.update_from_output(out, self._execute(out))

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        sampled: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        for sreq in out.scheduled:
            if b"CRASH" in bytes(t for t in sreq.token_ids[: sreq.num_prompt_tokens] if t < 256):
                raise RuntimeError("the fake model crashed on purpose")
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

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Nothing to release: the fake holds no device memory."""


def failing_core(config: EngineConfig) -> FakeEngineCore:
    """A core factory that refuses the configuration, as EngineCore does for a bad flag."""
    raise ParamError("--max-model-len", f"{config.max_model_len} exceeds the model's 8 positions")
