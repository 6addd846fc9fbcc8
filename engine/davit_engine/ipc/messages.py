"""Typed messages between the API process and the engine-core process.

Everything here is pickled across a pipe, so fields are Python scalars, lists and the plain
dataclasses of `davit_engine.types`; never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from davit_engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestDelta,
    TokenLogprob,
)

# --- API process -> engine core ---------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """Admit `request`; the core answers with `Admitted` or `Rejected` for its id."""

    request: EngineRequest


@dataclass(frozen=True)
class AbortRequests:
    """Stop these requests and free their blocks. Unknown or finished ids are ignored."""

    request_ids: list[str]


@dataclass(frozen=True)
class GetStats:
    """Ask for a fresh `EngineStats`; answered by `StatsReply` with the same `token`."""

    token: int


@dataclass(frozen=True)
class Shutdown:
    """Abort everything, release the device and exit the loop."""


InputMessage = AddRequest | AbortRequests | GetStats | Shutdown

# --- engine core -> API process ---------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The model is loaded and the loop runs. `model_info` is the core's ModelInfo as a dict."""

    model_info: dict[str, Any]


@dataclass(frozen=True)
class Admitted:
    request_id: str


@dataclass(frozen=True)
class Rejected:
    """Admission failed. `kind` is `param` (the user must fix `param`) or `queue_full`.

    `retry_after_s` is the core's hint for a full queue (the HTTP `Retry-After` header).
    """

    request_id: str
    kind: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Deltas:
    """What one engine step produced, for every request that made progress.

    `stats` is the core's state right after the step (or after applying inputs while idle), so
    the front end always knows the latest state without asking and waiting for a step to end.
    When the front end reads slower than the core steps, the core sends the steps that queued
    up as one `Deltas` (see `coalesce`): then a request's delta carries several steps' tokens.
    """

    deltas: list[RequestDelta] = field(default_factory=list)
    stats: EngineStats | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as rows of plain values: several times cheaper to write (in the core, every
        # step) and to read (in the API process) than one pickled dataclass per delta.
        rows = [
            (
                d.request_id,
                d.new_token_ids,
                None
                if d.logprobs is None
                else [(lp.token_id, lp.logprob, lp.top) for lp in d.logprobs],
                d.finish_reason,
                d.stop_token_id,
                d.num_prompt_tokens,
                d.num_cached_tokens,
                d.error,
            )
            for d in self.deltas
        ]
        return (_deltas_from_rows, (rows, self.stats))

    @staticmethod
    def coalesce(messages: list[Deltas]) -> Deltas:
        """Consecutive messages as one: one delta per request (first-seen order), latest stats."""
        if len(messages) == 1:
            return messages[0]
        by_request: dict[str, list[RequestDelta]] = {}
        stats = None
        for message in messages:
            for delta in message.deltas:
                by_request.setdefault(delta.request_id, []).append(delta)
            if message.stats is not None:
                stats = message.stats
        return Deltas([merge_deltas(deltas) for deltas in by_request.values()], stats)


_DeltaRow = tuple[
    str,
    list[int],
    list[tuple[int, float, list[tuple[int, float]]]] | None,
    FinishReason | None,
    int | None,
    int,
    int,
    str | None,
]


def _deltas_from_rows(rows: list[_DeltaRow], stats: EngineStats | None) -> Deltas:
    return Deltas(
        [
            RequestDelta(
                request_id,
                token_ids,
                None if logprobs is None else [TokenLogprob(*lp) for lp in logprobs],
                finish_reason,
                stop_token_id,
                num_prompt_tokens,
                num_cached_tokens,
                error,
            )
            for (
                request_id,
                token_ids,
                logprobs,
                finish_reason,
                stop_token_id,
                num_prompt_tokens,
                num_cached_tokens,
                error,
            ) in rows
        ],
        stats,
    )


def merge_deltas(deltas: list[RequestDelta]) -> RequestDelta:
    """One request's consecutive deltas as one: the same tokens, logprobs and outcome.

    Token ids and logprobs are concatenated in order; the finish reason and stop token are the
    last delta's (only the last one of a request can carry them, and an error); prompt and cache
    counts are the latest reported.
    """
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    for delta in deltas:
        token_ids += delta.new_token_ids
        if delta.logprobs is not None:
            if logprobs is None:
                logprobs = []
            logprobs += delta.logprobs
    return RequestDelta(
        last.request_id,
        token_ids,
        logprobs,
        last.finish_reason,
        last.stop_token_id,
        max(d.num_prompt_tokens for d in deltas),
        max(d.num_cached_tokens for d in deltas),
        last.error,
    )


@dataclass(frozen=True)
class StatsReply:
    token: int
    stats: EngineStats


@dataclass(frozen=True)
class CoreFailed:
    """The core hit an error it cannot recover from; the process exits after sending this."""

    message: str


OutputMessage = Ready | Admitted | Rejected | Deltas | StatsReply | CoreFailed
