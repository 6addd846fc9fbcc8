"""The contract between the scheduler and the model runners.

`Scheduler.schedule()` returns a `SchedulerOutput`; a runner executes it and returns a
`RunnerOutput`; `Scheduler.update_from_output()` turns that into `RequestDelta`s. Plain data only:
no torch here, so the scheduler stays testable without a device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from davit_engine.types import SamplingParams, TokenLogprob


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The runner computes tokens `token_ids[num_computed_tokens : num_computed_tokens +
    num_new_tokens]`, writing their K/V into the slots given by `block_ids`, and samples one
    token when `needs_sample` is set (a decode step, or the last chunk of a prefill).

    A speculating decode (`num_spec_tokens` K > 0) computes `1 + K` tokens: its last token and
    K drafts after it, which are `spec_token_ids` (the n-gram proposer's, possibly fewer than K:
    the runner pads the rest, never accepting padding) or, when `spec_token_ids` is None, the
    runner's draft model proposes all K on the device. The runner verifies the drafts and
    returns the accepted ones plus one token of the target (`RunnerOutput.spec_token_ids`).
    """

    request_id: str
    token_ids: list[int]  # prompt + generated so far; shared with the scheduler, read-only here
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose K/V are already in the cache (prefix hits included)
    num_new_tokens: int
    block_ids: list[int]  # the whole block table; covers num_computed_tokens + num_new_tokens
    sampling: SamplingParams
    needs_sample: bool
    is_new: bool = False  # first time this request (or its recompute after preemption) runs
    # Outputs sampled by steps still in flight when this one was scheduled: they are missing
    # from `token_ids` (asynchronous scheduling), and only a runner that keeps the drawn tokens
    # on the device (V2) can run such a step. Always 0 for `is_new` requests.
    num_pending_tokens: int = 0
    num_spec_tokens: int = 0  # K: draft positions the target computes (0: no speculation)
    spec_token_ids: list[int] | None = None  # host-proposed drafts (n-gram), at most K

    @property
    def num_draft_tokens(self) -> int:
        """Real drafts to verify (padding excluded)."""
        if not self.num_spec_tokens:
            return 0
        return len(self.spec_token_ids) if self.spec_token_ids is not None else self.num_spec_tokens

    @property
    def num_output_tokens(self) -> int:
        """Outputs before the token this step draws, placeholders included (valid at launch)."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step, plus the changes since the previous step.

    `finished_ids` and `preempted_ids` let a runner that keeps persistent per-request state
    (runner V2) drop it; a preempted request later comes back with `is_new=True`.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # The scheduler needs this step's tokens before it schedules the next one (speculative
    # decoding proposes drafts from them, and a verification's outcome moves the request):
    # a pipeline running ahead applies this step first.
    wants_host_tokens: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_speculation(self) -> bool:
        """Whether some request verifies drafts in this step."""
        return any(r.num_spec_tokens for r in self.scheduled)


@dataclass
class RunnerOutput:
    """Sampled tokens, one entry per scheduled request in `SchedulerOutput.scheduled` order.

    `sampled_token_ids[i]` is None where that request did not sample this step (a prefill chunk
    that is not the last one) or verified drafts. `logprobs[i]` is set only where the request
    asked for them. `spec_token_ids[i]`, for a request that verified drafts, lists the accepted
    drafts followed by the target's token (at least one token).
    """

    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprob | None] | None = None
    spec_token_ids: list[list[int] | None] | None = None
