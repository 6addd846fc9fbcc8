"""The engine core's state for one request: its tokens, progress, KV blocks and stop rules."""

from __future__ import annotations

import enum

from davit_engine.types import EngineRequest, FinishReason, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, never scheduled
    RUNNING = "running"  # holds KV blocks and is scheduled every step it fits the budget
    PREEMPTED = "preempted"  # lost its blocks; queued again to be recomputed from scratch
    # Holds fresh blocks that a lower KV tier (host memory, disk) is filling with its prefix;
    # queued again once they arrived, then admitted with them as prefix-cache hits.
    LOADING = "loading"
    FINISHED = "finished"


class Request:
    """Mutable per-request state owned by the scheduler.

    `token_ids` is the prompt followed by every generated token; it only ever grows, so the
    scheduler hands this very list to the runner each step instead of copying it. Tokens
    `[0, num_computed_tokens)` have their K/V in the blocks of `block_ids` (or are being
    computed by the step in flight). After a preemption the generated tokens are kept and
    recomputed together with the prompt, so `num_prompt_tokens` never changes.

    `num_pending_tokens` counts tokens a launched step samples that have not reached the host
    yet (asynchronous scheduling): they follow `token_ids` as placeholders, already counted in
    `num_computed_tokens` once the step that consumes them as inputs is scheduled.

    `is_verifying` marks a launched speculative step whose outcome is not on the host yet: how
    many tokens it adds (and so where the request continues) is unknown until then, so the
    request is not scheduled again before it lands.
    """

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "block_ids",
        "eos_token_ids",
        "finish_reason",
        "is_verifying",
        "lookup_counted",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_pending_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_registered_blocks",
        "request_id",
        "sampling",
        "status",
        "stop_token_id",
        "stop_token_ids",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival_time: float = 0.0,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        # A private copy: the caller's list must not grow with our outputs.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.arrival_time = arrival_time
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling.stop_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.is_verifying = False
        self.block_ids: list[int] = []
        # Chained prefix-cache hashes of this request's full blocks, computed lazily by the
        # block manager; valid for the request's lifetime because token_ids only grows.
        self.block_hashes: list[bytes] = []
        # Leading entries of block_ids already registered in (or taken from) the prefix cache.
        self.num_registered_blocks = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        # Set while a load from a lower tier is under way and until the admission after it:
        # that admission neither counts the prefix lookup again nor loads again.
        self.lookup_counted = False
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None

    @classmethod
    def from_engine_request(cls, req: EngineRequest) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            arrival_time=req.arrival_time,
            eos_token_ids=req.eos_token_ids,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Append a sampled token and return why the request must stop now, if it must.

        Rules, in order: EOS (unless `ignore_eos`) and `stop_token_ids` stop with STOP, but
        neither before `min_tokens` outputs exist; then `max_tokens` outputs or `max_model_len`
        total tokens stop with LENGTH. `stop_token_id` is set only for a `stop_token_ids` match,
        so the front end can tell a user stop token (reported as the stop reason) from EOS.
        """
        self.token_ids.append(token_id)
        num_output = len(self.token_ids) - self.num_prompt_tokens
        if num_output >= self.sampling.min_tokens:
            if token_id in self.eos_token_ids and not self.sampling.ignore_eos:
                return FinishReason.STOP
            if token_id in self.stop_token_ids:
                self.stop_token_id = token_id
                return FinishReason.STOP
        if num_output >= self.sampling.max_tokens or len(self.token_ids) >= max_model_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_ids)})"
        )
