"""Data types shared by the engine core, the runners and the HTTP front end.

These cross the process boundary between the API process and the engine-core process, so they
are plain dataclasses of Python scalars and lists (picklable, no tensors).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client went away or request was cancelled


class ParamError(ValueError):
    """A user-supplied parameter is invalid. `param` names the field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. `validate()` raises ParamError naming the field."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token; None = off
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logits_processors: tuple[str, ...] = ()  # names of registered custom logits processors

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, max_logprobs: int = 20) -> None:
        if self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ParamError(
                "temperature", f"temperature must be in [0, 2], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ParamError("top_k", f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise ParamError(
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ParamError(name, f"{name} must be in [-2, 2], got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= max_logprobs:
                raise ParamError(name, f"{name} must be in [0, {max_logprobs}], got {value}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
            )
        if len(self.stop) > 16:
            raise ParamError("stop", "at most 16 stop strings are allowed")
        if any(not s for s in self.stop):
            raise ParamError("stop", "stop strings must not be empty")


@dataclass(frozen=True)
class EngineRequest:
    """A request as the engine core receives it: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestDelta:
    """What one engine step produced for one request: the new tokens since the last delta.

    The engine core emits token ids; detokenization and stop-string matching happen in the
    output processor (front-end side), which may finish a request early and then aborts it.
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the token that triggered a STOP, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """A snapshot of the engine core's state for metrics and readiness."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
