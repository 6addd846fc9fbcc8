"""Continuous batching: which requests run each step, with how many tokens, in which KV blocks.

One step is `schedule()` → the runner executes the `SchedulerOutput` → `update_from_output()`.
`schedule()` counts the tokens it hands out as computed, and `update_from_output()` appends what
the runner sampled, finishes requests and registers the blocks that became full in the prefix
cache. With asynchronous scheduling the next `schedule()` comes before the previous step's
`update_from_output()`: a token still being sampled is a placeholder (`num_pending_tokens`) that
the next step already consumes as its input, and a stop found one step late drops the extra
token, so the outputs are the same as with the calls strictly alternating.

Speculative decoding (`config.speculative_config`): an eligible decode request verifies K
drafts, so it takes `1 + K` tokens of `max_num_batched_tokens` (the budget counts target
tokens only; a draft model's own work never takes budget) and KV slots for all of them. At most
`max_num_spec_seqs` requests verify per step (the runner's verification and draft buffers are
sized for that many); the others decode normally. n-gram drafts are proposed here, on the host;
a step verifies drafts only when at least one eligible request has a proposal, and then every
eligible request within the cap verifies (those without drafts verify none), so the step stays
uniform (K + 1 tokens per request) for the runner's CUDA graphs. A draft model proposes on the
device, for every eligible request. Drafts come from a request's latest tokens and a
verification's outcome (how many tokens it adds) decides where the request continues, so a
step holding requests that may speculate asks to be applied before the next one is scheduled
(`SchedulerOutput.wants_host_tokens`): those requests step synchronously, while requests that
cannot speculate (logprobs, penalties, ...) keep the asynchronous pipeline. A verifying
request is never scheduled again before its step landed. Rejected drafts roll back
`num_computed_tokens`; their slots stay in the request's blocks for its next step and are freed
with the request.

KV tiers below the GPU (`core.kv_tiers.LowerTiers`, optional): a request whose prefix continues
in a lower tier past the GPU prefix cache is given fresh blocks for that part and set LOADING
while the tier fills them; it takes no step budget and others keep running. When the load has
landed, its intact blocks are registered in the prefix cache, the request's blocks are
released (the loaded ones stay cached, most recently used) and it goes back to the front of the
queue, where its admission finds them as ordinary prefix-cache hits and computes the rest. A
request aborted while loading keeps its blocks until the load has landed: the tier may still
be writing them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput, ScheduledRequest, SchedulerOutput
from davit_engine.core.block_manager import BlockManager
from davit_engine.core.kv_tiers import LowerTiers
from davit_engine.core.request import Request, RequestStatus
from davit_engine.spec_decode.config import max_speculating_seqs
from davit_engine.spec_decode.ngram import NgramProposer
from davit_engine.spec_decode.stats import SpecDecodeStats
from davit_engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    ParamError,
    RequestDelta,
    SamplingParams,
)


class QueueFullError(Exception):
    """The waiting queue is full: the request was NOT accepted; retry after `retry_after` s.

    The front end answers HTTP 429 with a `Retry-After` header (rounded up to whole seconds).
    """

    def __init__(self, num_queued: int, max_queue_len: int, retry_after: float) -> None:
        super().__init__(
            f"the engine's queue is full ({num_queued} requests queued, --max-queue-len "
            f"{max_queue_len}); retry after {retry_after:g} s"
        )
        self.num_queued = num_queued
        self.max_queue_len = max_queue_len
        self.retry_after = retry_after


@dataclass
class _Load:
    """A request whose blocks after its first `num_gpu_blocks` are being filled by a tier."""

    req: Request
    num_gpu_blocks: int
    previous_status: RequestStatus  # WAITING or PREEMPTED: what it is again once landed


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix caching and preemption by recompute.

    Each step first serves the running requests in admission order (decodes and continuing
    prefill chunks), then admits waiting requests in arrival order while the token budget
    (`max_num_batched_tokens`), the sequence limit (`max_num_seqs`) and free KV blocks allow.
    When a running request needs a block and none is free, the most recently admitted running
    request is preempted: its blocks are freed and it goes back to the front of the queue to be
    recomputed (prompt and outputs so far) later. An accepted request is never dropped: it ends
    only by finishing or by `abort()`.

    Not thread-safe: the engine loop calls every method from one thread, between steps.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        *,
        queue_retry_after: float = 1.0,
        tiers: LowerTiers | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        # A request may grow only as far as the whole KV cache holds: a longer one would
        # preempt itself forever. It stops with LENGTH there instead.
        max_model_len = min(max_model_len, num_blocks * config.block_size)
        if max_model_len < 2:
            raise ParamError(
                "--max-model-len",
                f"must leave room for a prompt token and an output token, got {max_model_len}",
            )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            # A preempted request is recomputed in one piece, up to max_model_len tokens.
            raise ParamError(
                "--max-num-batched-tokens",
                f"must be >= max_model_len ({max_model_len}) when chunked prefill is disabled, "
                f"got {config.max_num_batched_tokens}",
            )
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_queue_len = config.max_queue_len
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.queue_retry_after = queue_retry_after
        self._admission_reserve = -(-num_blocks // 100)  # 1% of the pool, at least one block
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, tiers
        )
        self.tiers = self.block_manager.tiers
        self._loading: dict[int, _Load] = {}  # by load id; aborted ones until they land
        self._num_live_loads = 0  # entries of _loading not aborted: they take sequence slots
        self._next_load_id = 0
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order: the last one is preempted first
        self._finished_ids: list[str] = []  # reported in the next SchedulerOutput
        self._num_preemptions = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.max_num_spec_seqs = (
            max_speculating_seqs(
                config.max_num_seqs, config.max_num_batched_tokens, self.num_spec_tokens
            )
            if spec is not None
            else 0
        )
        self._ngram: NgramProposer | None = None
        if spec is not None and spec.method == "ngram":
            assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
            self._ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.spec_stats = SpecDecodeStats(self.num_spec_tokens) if spec is not None else None
        # "separate": draft work takes no target budget. "reserved": the upstream-style
        # reservation of max_num_seqs x K budget tokens for drafts, kept for comparison in the
        # benchmarks only.
        self.draft_budget = "separate"

    # ---- admission --------------------------------------------------------------------------

    def add_request(self, engine_request: EngineRequest) -> None:
        """Queue a request, or refuse it without side effects.

        Raises ParamError("prompt") for an empty prompt or one that leaves no room for a single
        output token within max_model_len or the KV cache, ParamError("request_id") for an id
        already in use, and QueueFullError when `max_queue_len` requests already wait beyond
        the free running slots (requests about to take a free slot do not count as queued).
        """
        request_id = engine_request.request_id
        if request_id in self._requests:
            raise ParamError("request_id", f"request id {request_id!r} is already in use")
        num_prompt = len(engine_request.prompt_token_ids)
        if num_prompt == 0:
            raise ParamError("prompt", "the prompt must contain at least one token")
        if num_prompt + 1 > self.max_model_len:
            raise ParamError(
                "prompt",
                f"the prompt has {num_prompt} tokens; with at least 1 output token this exceeds "
                f"the maximum context length of {self.max_model_len} tokens"
                + self._capacity_note(),
            )
        if self.max_queue_len is not None:
            free_slots = max(0, self.max_num_seqs - len(self._running))
            if len(self._waiting) >= free_slots + self.max_queue_len:
                raise QueueFullError(self.num_queued, self.max_queue_len, self.queue_retry_after)
        req = Request.from_engine_request(engine_request)
        self._requests[request_id] = req
        self._waiting.append(req)

    def _capacity_note(self) -> str:
        capacity = self.block_manager.num_blocks * self.block_size
        if capacity > self.max_model_len:
            return ""
        return f" (capped by the KV cache: {self.block_manager.num_blocks} blocks of {self.block_size})"

    def abort(self, request_id: str) -> bool:
        """Finish a waiting or running request now and free its blocks.

        Returns False when the id is unknown or already finished. The id is reported in the
        next SchedulerOutput's `finished_ids`; no RequestDelta is emitted for it.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.LOADING:
            # Its blocks are freed when the load lands (the tier may still write them).
            if self._ngram is not None:
                self._ngram.forget(request_id)
            req.status = RequestStatus.FINISHED
            req.finish_reason = FinishReason.ABORT
            self._num_live_loads -= 1
            self._finished_ids.append(req.request_id)
            return True
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        return True

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step and count its tokens as computed.

        Every scheduled request's block table covers `num_computed_tokens + num_new_tokens`
        tokens when this returns. `ScheduledRequest.token_ids` and `.block_ids` are the
        request's own lists (no copies): the runner must treat them as read-only.
        """
        if self._loading:
            self._land_loads()
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        if self.num_spec_tokens and self.draft_budget == "reserved":
            budget = max(1, budget - self.max_num_seqs * self.num_spec_tokens)
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        running = self._running
        block_size = self.block_size
        drafts = self._propose() if self.num_spec_tokens else {}
        num_spec = 0

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.is_verifying:
                i += 1  # its verification has not landed: where it continues is unknown
                continue
            num_pending = req.num_pending_tokens
            if num_pending and self._pending_reach_length(req):
                i += 1  # finishes when its pending token lands: nothing left to compute
                continue
            num_new = min(len(req.token_ids) + num_pending - req.num_computed_tokens, budget)
            if num_new <= 0:
                # Nothing to compute: its last sample has not been appended (misuse guard).
                i += 1
                continue
            spec = drafts.get(req.request_id)
            num_spec_tokens = 0
            fits = num_spec < self.max_num_spec_seqs and 1 + self.num_spec_tokens <= budget
            if spec is not None and fits:
                num_spec_tokens = self.num_spec_tokens
                num_new = 1 + num_spec_tokens
                num_spec += 1
            num_needed = req.num_computed_tokens + num_new
            # Most decode steps stay inside the last block: skip the block manager then.
            if num_needed > len(req.block_ids) * block_size:
                while not bm.can_append_slots(req, num_needed):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    break  # req preempted itself: everything after it is gone too
                bm.append_slots(req, num_needed)
            item = self._make_scheduled(req, num_new, is_new=False)
            if num_spec_tokens:
                item.num_spec_tokens = num_spec_tokens
                item.spec_token_ids = spec if self._ngram is not None else None
                item.needs_sample = True  # no placeholder token: its outcome is a list
                req.is_verifying = True
            scheduled.append(item)
            budget -= num_new
            i += 1

        # After a preemption there are no blocks to spare for newcomers.
        if not preempted:
            budget = self._admit_waiting(scheduled, budget)

        out = SchedulerOutput(scheduled, self._finished_ids, preempted)
        if self.num_spec_tokens:
            out.wants_host_tokens = any(self._spec_features_ok(s.sampling) for s in scheduled)
        self._finished_ids = []
        return out

    def _propose(self) -> dict[str, list[int]]:
        """Drafts of the running requests that may verify this step (by id): n-gram proposals
        (only when at least one request has one), or empty lists for the draft model's rows."""
        k = self.num_spec_tokens
        drafts: dict[str, list[int]] = {}
        any_draft = False
        for req in self._running:
            if len(drafts) >= self.max_num_spec_seqs:
                break
            if not self._may_speculate(req):
                continue
            proposal: list[int] = []
            if self._ngram is not None:
                proposal = self._ngram.propose(req.request_id, req.token_ids, k)
                any_draft = any_draft or bool(proposal)
            drafts[req.request_id] = proposal
        if self._ngram is not None and not any_draft:
            return {}  # nobody has a draft: everyone decodes normally (and asynchronously)
        return drafts

    def _may_speculate(self, req: Request) -> bool:
        """A decode whose tokens are all on the host, whose features verification keeps
        exact (no logprobs, penalties, pending min_tokens or custom processors), with room for
        K + 1 positions and at least two more outputs."""
        if req.is_verifying or req.num_pending_tokens:
            return False
        num_tokens = len(req.token_ids)
        if num_tokens - req.num_computed_tokens != 1:
            return False  # still prefilling
        p = req.sampling
        num_output = num_tokens - req.num_prompt_tokens
        return (
            self._spec_features_ok(p)
            and num_output >= p.min_tokens
            and p.max_tokens - num_output >= 2
            and num_tokens + self.num_spec_tokens < self.max_model_len
        )

    @staticmethod
    def _spec_features_ok(p: SamplingParams) -> bool:
        """Sampling features verification keeps exact: not logprobs, penalties or custom
        logits processors (those requests decode normally)."""
        return (
            p.logprobs is None
            and p.prompt_logprobs is None
            and not p.logits_processors
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
        )

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        bm = self.block_manager
        waiting = self._waiting
        running = self._running
        while waiting and budget > 0 and len(running) + self._num_live_loads < self.max_num_seqs:
            req = waiting[0]
            if req.num_pending_tokens or req.is_verifying:
                # Preempted with a token in flight: a recompute needs every token on the host.
                break
            # Prompt logprobs need logits at every prompt position: nothing may be skipped.
            wants_prompt_logprobs = req.sampling.prompt_logprobs is not None
            cached_block_ids = [] if wants_prompt_logprobs else bm.match_prefix(req)
            # While others run, keep a few blocks back for their decode growth: admitting a
            # request only to preempt it (and recompute it) a step later wastes a prefill.
            reserve = self._admission_reserve if running else 0
            # Right after its load landed a request computes whatever is still missing: a
            # damaged block its tier still lists must not send it back into a load forever.
            if self.tiers is not None and not wants_prompt_logprobs and not req.lookup_counted:
                tier_hashes = bm.match_lower_tiers(req, len(cached_block_ids))
                if tier_hashes:
                    started = self._start_load(req, cached_block_ids, tier_hashes, reserve)
                    if started is None:
                        break  # no blocks to load into yet: FCFS, it waits at the head
                    if started:
                        waiting.popleft()
                        continue
            num_cached = len(cached_block_ids) * self.block_size
            num_new = len(req.token_ids) - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break  # FCFS: later requests wait behind it rather than overtake it
                num_new = budget
            if not bm.can_allocate(cached_block_ids, num_cached + num_new, reserve):
                break
            bm.allocate(
                req, cached_block_ids, num_cached + num_new, count_lookup=not req.lookup_counted
            )
            req.lookup_counted = False
            waiting.popleft()
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            running.append(req)
            scheduled.append(self._make_scheduled(req, num_new, is_new=True))
            budget -= num_new
        return budget

    def _start_load(
        self, req: Request, cached_block_ids: list[int], tier_hashes: list[bytes], reserve: int
    ) -> bool | None:
        """Give `req` its GPU hits plus fresh blocks for the blocks a lower tier holds (as many
        as are free beyond `reserve`) and start the load. None: no block is free for it now;
        False: the tier started nothing (`req` holds no blocks again, compute it); True:
        `req` is LOADING."""
        bm = self.block_manager
        num_gpu = len(cached_block_ids)
        num_revived = sum(1 for b in cached_block_ids if bm.ref_count(b) == 0)
        room = bm.num_free_blocks - num_revived - reserve
        num_load = min(len(tier_hashes), room)
        if num_load <= 0:
            return None
        bm.allocate(
            req,
            cached_block_ids,
            (num_gpu + num_load) * self.block_size,
            count_lookup=not req.lookup_counted,
        )
        req.lookup_counted = True
        assert self.tiers is not None
        load_id = self._next_load_id
        self._next_load_id += 1
        num_started = self.tiers.load(load_id, tier_hashes[:num_load], req.block_ids[num_gpu:])
        if num_started == 0:
            bm.free(req)
            return False
        self._loading[load_id] = _Load(req, num_gpu, req.status)
        self._num_live_loads += 1
        req.status = RequestStatus.LOADING
        return True

    def _land_loads(self) -> None:
        """Queue the requests whose loads ended at the front (in arrival order), with their
        intact blocks registered in the prefix cache and every block released."""
        assert self.tiers is not None
        bm = self.block_manager
        landed: list[Request] = []
        for load_id, num_intact in self.tiers.finished_loads():
            load = self._loading.pop(load_id)
            req = load.req
            if req.status is RequestStatus.FINISHED:  # aborted while loading
                bm.free(req)
                continue
            self._num_live_loads -= 1
            bm.cache_full_blocks(req, (load.num_gpu_blocks + num_intact) * self.block_size)
            bm.free(req)
            req.status = load.previous_status
            landed.append(req)
        landed.sort(key=lambda r: r.arrival_time, reverse=True)
        self._waiting.extendleft(landed)

    def _pending_reach_length(self, req: Request) -> bool:
        """Whether the request reaches max_tokens or max_model_len once its pending tokens land
        (it then finishes, whatever they are)."""
        num_tokens = len(req.token_ids) + req.num_pending_tokens
        return (
            num_tokens - req.num_prompt_tokens >= req.sampling.max_tokens
            or num_tokens >= self.max_model_len
        )

    def _make_scheduled(self, req: Request, num_new: int, is_new: bool) -> ScheduledRequest:
        num_computed = req.num_computed_tokens
        num_pending = req.num_pending_tokens
        req.num_computed_tokens = num_computed + num_new
        needs_sample = num_computed + num_new == len(req.token_ids) + num_pending
        if needs_sample:
            req.num_pending_tokens = num_pending + 1
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_ids,
            num_prompt_tokens=req.num_prompt_tokens,
            num_computed_tokens=num_computed,
            num_new_tokens=num_new,
            block_ids=req.block_ids,
            sampling=req.sampling,
            needs_sample=needs_sample,
            is_new=is_new,
            num_pending_tokens=num_pending,
        )

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, res: RunnerOutput) -> list[RequestDelta]:
        """Apply the runner's samples for `out`; return one delta per request that got a token.

        Requests aborted or finished while the step ran are skipped (their extra token is
        dropped). A request preempted while the step ran still gets its token. Finished
        requests free their blocks (full ones stay in the prefix cache) and are reported in the
        next `finished_ids`.
        """
        scheduled = out.scheduled
        sampled = res.sampled_token_ids
        if len(sampled) != len(scheduled):
            raise ValueError(
                f"runner returned {len(sampled)} samples for {len(scheduled)} scheduled requests"
            )
        logprobs = res.logprobs
        bm = self.block_manager
        requests = self._requests
        max_model_len = self.max_model_len
        block_size = self.block_size
        caching = bm.enable_prefix_caching
        deltas: list[RequestDelta] = []
        num_generated = 0
        any_finished = False
        for i, sreq in enumerate(scheduled):
            req = requests.get(sreq.request_id)
            # The token list identifies the request: an id can be reused after a finish.
            if req is None or req.token_ids is not sreq.token_ids:
                continue
            is_running = req.status is RequestStatus.RUNNING
            if sreq.num_spec_tokens:
                reason = self._apply_verification(req, sreq, res, i, is_running, deltas)
                num_generated += len(deltas[-1].new_token_ids)
                if reason is not None:
                    any_finished = True
                continue
            num_computed = sreq.num_computed_tokens + sreq.num_new_tokens
            if is_running and caching and num_computed // block_size > req.num_registered_blocks:
                bm.cache_full_blocks(req, num_computed)
            token_id = sampled[i]
            if token_id is None:
                if sreq.needs_sample:
                    # Skipping it would leave the request with nothing to compute, forever.
                    raise ValueError(f"runner sampled no token for {sreq.request_id}")
                continue
            if not sreq.needs_sample:
                raise ValueError(f"runner sampled a token for {sreq.request_id} mid-prefill")
            req.num_pending_tokens -= 1
            reason = req.append_output_token(token_id, max_model_len)
            num_generated += 1
            if len(req.token_ids) - req.num_prompt_tokens == 1:
                self._prompt_tokens_total += req.num_prompt_tokens
            logprob = logprobs[i] if logprobs is not None else None
            deltas.append(
                RequestDelta(
                    request_id=req.request_id,
                    new_token_ids=[token_id],
                    logprobs=[logprob] if logprob is not None else None,
                    finish_reason=reason,
                    stop_token_id=req.stop_token_id,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
            if reason is not None:
                del requests[req.request_id]
                if not is_running:
                    self._waiting.remove(req)  # preempted while its last token was drawn
                self._finish(req, reason)
                any_finished = True
        self._generation_tokens_total += num_generated
        if any_finished:
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        return deltas

    def _apply_verification(
        self,
        req: Request,
        sreq: ScheduledRequest,
        res: RunnerOutput,
        row: int,
        is_running: bool,
        deltas: list[RequestDelta],
    ) -> FinishReason | None:
        """Append a verification step's tokens (accepted drafts, then the target's own), roll
        the rejected slots back and register the blocks that became full."""
        tokens = res.spec_token_ids[row] if res.spec_token_ids is not None else None
        if not tokens or len(tokens) > sreq.num_spec_tokens + 1:
            raise ValueError(f"runner returned {tokens!r} for {sreq.request_id}'s verification")
        req.is_verifying = False
        num_accepted = len(tokens) - 1
        if self.spec_stats is not None:
            self.spec_stats.observe(sreq.num_draft_tokens, num_accepted)
        if is_running:
            # Slots of rejected drafts are rolled back: the next step overwrites their K/V.
            req.num_computed_tokens -= sreq.num_spec_tokens - num_accepted
        reason = None
        appended: list[int] = []
        for token_id in tokens:
            reason = req.append_output_token(token_id, self.max_model_len)
            appended.append(token_id)
            if reason is not None:
                break  # an EOS or a limit among the accepted tokens: the rest is dropped
        if is_running and self.block_manager.enable_prefix_caching:
            valid = min(req.num_computed_tokens, len(req.token_ids))
            if valid // self.block_size > req.num_registered_blocks:
                self.block_manager.cache_full_blocks(req, valid)
        deltas.append(
            RequestDelta(
                request_id=req.request_id,
                new_token_ids=appended,
                finish_reason=reason,
                stop_token_id=req.stop_token_id,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
            )
        )
        if reason is not None:
            del self._requests[req.request_id]
            if not is_running:
                self._waiting.remove(req)  # preempted while its step ran
            self._finish(req, reason)
        return reason

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if self._ngram is not None:
            self._ngram.forget(req.request_id)
        self.block_manager.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self._finished_ids.append(req.request_id)

    # ---- inspection -------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Whether requests wait or run, or loads (aborted ones too) have not landed yet."""
        return bool(self._waiting or self._running or self._loading)

    @property
    def num_loading(self) -> int:
        """Requests waiting for their prefix from a lower tier (aborted ones excluded)."""
        return self._num_live_loads

    @property
    def has_runnable(self) -> bool:
        """Whether a step could schedule anything (false while only loads are pending)."""
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        """Requests in the queue, preempted ones included."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        """Waiting requests beyond the running slots still free: what max_queue_len limits."""
        free_slots = max(0, self.max_num_seqs - len(self._running))
        return max(0, len(self._waiting) - free_slots)

    def get_request(self, request_id: str) -> Request | None:
        """The live request with this id; None once it finished or was aborted."""
        return self._requests.get(request_id)

    def check_invariants(self) -> None:
        """Verify queue, state and block bookkeeping against each other (for tests; O(n))."""
        loading = [load.req for load in self._loading.values()]
        live_loading = [r for r in loading if r.status is RequestStatus.LOADING]
        live = [*self._running, *self._waiting, *live_loading]
        if len({id(r) for r in live}) != len(live) or len(live) != len(self._requests):
            raise AssertionError("a request is queued twice, or a live request is in no queue")
        if len(live_loading) != self._num_live_loads:
            raise AssertionError("the count of live loads disagrees with the loads")
        if len(self._running) + self._num_live_loads > self.max_num_seqs:
            raise AssertionError("more running and loading requests than max_num_seqs")
        for req in self._running:
            if req.status is not RequestStatus.RUNNING or self._requests[req.request_id] is not req:
                raise AssertionError(f"{req.request_id} is in the running list but not running")
            if len(req.block_ids) * self.block_size < req.num_computed_tokens:
                raise AssertionError(f"{req.request_id} has computed tokens outside its blocks")
        for req in self._waiting:
            if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or req.block_ids:
                raise AssertionError(f"{req.request_id} waits but holds blocks or is running")
        for req in loading:
            if req.status not in (RequestStatus.LOADING, RequestStatus.FINISHED):
                raise AssertionError(f"{req.request_id} is in a load but neither loading nor done")
        self.block_manager.check_invariants([*self._running, *self._waiting, *loading])

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=bm.usage,
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_loading=self._num_live_loads,
            **self._spec_stats_fields(),
        )

    def _spec_stats_fields(self) -> dict[str, Any]:
        spec, stats = self.config.speculative_config, self.spec_stats
        if spec is None or stats is None:
            return {}
        return {
            "spec_verification": spec.verification,
            "spec_num_drafts": stats.num_drafts,
            "spec_num_draft_tokens": stats.num_draft_tokens,
            "spec_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_accepted_per_position": list(stats.accepted_per_position),
        }
