"""Data types shared by the engine core, the runners and the HTTP front end.

These cross the process boundary between the API process and the engine-core process, so they
are plain dataclasses of Python scalars and lists (picklable, no tensors).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

# Range limits every runner can represent. Runner V2 packs per-request parameters into int32
# and float32 device tables (runner/v2/state.py), and seeds travel as int64 (OpenAI's type).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this temperature a request samples greedily, as upstream treats it: 1 / T would
# overflow float32 logits (temperature 1e-45 is float32's smallest step above zero).
GREEDY_TEMPERATURE = 1e-5
# A top_p at or below the top token's probability keeps only the top token. That probability
# is at least 1 / vocabulary size, so raising a smaller top_p to this floor changes no result,
# while values that round to zero in float32 would drop every token.
MIN_TOP_P = 1e-10
# Logits are divided or multiplied by the repetition penalty in float32: outside this range a
# finite logit can become infinite and the draw degenerate.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client went away or request was cancelled
    ERROR = "error"  # the engine failed while running this request (only this one)


class ParamError(ValueError):
    """A user-supplied parameter is invalid. `param` names the field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in worker threads and processes too: pickles with both fields.
        return (ParamError, (self.param, self.message))


def _check_int(name: str, value: int, low: int, high: int, allowed: str) -> None:
    if not low <= value <= high:
        raise ParamError(name, f"{name} must be {allowed}, got {value}")


def _check_float(name: str, value: float, low: float, high: float, allowed: str) -> None:
    # `not low <= x <= high` is also true for NaN.
    if not math.isfinite(value) or not low <= value <= high:
        raise ParamError(name, f"{name} must be {allowed}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. `validate()` raises ParamError naming the field.

    Every number must be finite and within what every runner represents (`validate()` names
    the allowed range): integers fit int32 (seed: int64), floats are finite and stay finite
    in the float32 sampler. Two values map to documented equivalents, as upstream maps them:
    a temperature below GREEDY_TEMPERATURE (1e-5) samples greedily (`is_greedy`), and a
    positive top_p below MIN_TOP_P (1e-10) is raised to it (both keep only the top token).
    top_k 0 or -1 turns top-k off.
    """

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

    def __post_init__(self) -> None:
        if isinstance(self.top_p, float) and 0.0 < self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self, max_logprobs: int = 20) -> None:
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX, f"in [1, {INT32_MAX}]")
        _check_float("temperature", self.temperature, 0.0, 2.0, "in [0, 2]")
        if self.top_p <= 0.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_float("top_p", self.top_p, 0.0, 1.0, "in (0, 1]")
        _check_int("top_k", self.top_k, -1, INT32_MAX, f"0 or -1 (off), or in [1, {INT32_MAX}]")
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        _check_float(
            "repetition_penalty", self.repetition_penalty, low, high, f"in [{low:g}, {high:g}]"
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0, "in [-2, 2]")
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX, "a 64-bit signed integer")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, max_logprobs, f"in [0, {max_logprobs}]")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, INT32_MAX, "token ids (>= 0)")
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
    error: str | None = None  # why the engine failed the request (with FinishReason.ERROR)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# Upper bounds (seconds) of the KV tiers' load-latency histogram buckets (+Inf implied).
KV_TIER_LOAD_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass
class KvTierStats:
    """Counters of one KV offload tier ("cpu" or "disk") since the engine started.

    `hits`/`misses`: tokens of prompt prefixes looked up in this tier past the GPU prefix cache
    (a lookup ends at the first block no tier holds, which is a miss of every tier it was
    looked up in). `load_*`: blocks copied from this tier into the GPU cache (the latency of a
    load is counted for the lowest tier it read from). `failures` by reason: "corrupt",
    "truncated", "foreign", "io_error", "disk_full", "missing".
    """

    tier: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    hits: int = 0
    misses: int = 0
    load_bytes: int = 0
    store_bytes: int = 0
    dropped_stores: int = 0  # blocks not stored (no room, a backlog of writes)
    load_seconds: float = 0.0
    load_count: int = 0
    # Loads per latency bucket (not cumulative); the last entry counts those above every bound.
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(KV_TIER_LOAD_BUCKETS) + 1))
    failures: dict[str, int] = field(default_factory=dict)


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
    # Speculative decoding (upstream's counters); `spec_verification` labels them: "strict",
    # "fly" or "synthetic" ("" without speculative decoding).
    spec_verification: str = ""
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # KV offload tiers below the GPU prefix cache (empty without them); requests waiting for
    # their prefix from one of them.
    kv_offload: list[KvTierStats] = field(default_factory=list)
    num_loading: int = 0
