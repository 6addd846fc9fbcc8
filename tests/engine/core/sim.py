"""A deterministic stand-in for a model runner that checks the scheduler's KV bookkeeping.

Real K/V at a position depend on the whole prefix up to it. The simulated runner stores, per
KV slot (block id, offset), a digest of the prefix ending at that position, and computes each
new position from the previous position's digest READ BACK FROM THE CACHE, the way attention
reads earlier K/V. A wrong prefix-cache hit, a block table missing a slot, or a block reused
while another request still needs it therefore either fails a check here or changes the
sampled tokens, which tests compare against an uncontended reference run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput, ScheduledRequest, SchedulerOutput
from davit_engine.core.scheduler import Scheduler
from davit_engine.types import EngineRequest, RequestDelta, TokenLogprob

_MASK = (1 << 61) - 1
_ROOT = 0x5EED


def mix(prev: int, token_id: int) -> int:
    """Digest of a prefix from the digest of the prefix one shorter and the next token."""
    return hash((prev, token_id)) & _MASK


def prefix_digest(token_ids: list[int], end: int) -> int:
    """Digest of `token_ids[:end]` computed directly, without any cache."""
    value = _ROOT
    for token_id in token_ids[:end]:
        value = mix(value, token_id)
    return value


class SimRunner:
    """Executes SchedulerOutputs against a simulated paged KV cache.

    The next token is a pure function of the whole sequence so far (`digest % vocab_size`), so
    a request's output is the same whatever it is batched with, preempted or served from the
    prefix cache. `eos_token_id`, when given, is emitted whenever `digest % eos_every == 0`.
    """

    name = "sim"
    supports_async_scheduling = False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        eos_token_id: int | None = None,
        eos_every: int = 0,
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_every = eos_every
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.num_computed_total = 0  # tokens whose K/V this runner computed, over all steps
        self.steps: list[SchedulerOutput] = []

    def next_token(self, digest: int) -> int:
        if self.eos_token_id is not None and self.eos_every and digest % self.eos_every == 0:
            return self.eos_token_id
        return digest % self.vocab_size

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps.append(out)
        bs = self.block_size
        written: dict[tuple[int, int], str] = {}
        sampled: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        for sreq in out.scheduled:
            start = sreq.num_computed_tokens
            end = start + sreq.num_new_tokens
            tokens = sreq.token_ids
            assert sreq.num_new_tokens > 0, sreq
            assert end <= len(tokens), f"{sreq.request_id} computes past its tokens"
            assert len(sreq.block_ids) * bs >= end, f"{sreq.request_id}: block table too short"
            if start:
                last = start - 1
                prev = self.kv[sreq.block_ids[last // bs]][last % bs]
                # The cached prefix must be exactly this request's prefix.
                assert prev == prefix_digest(tokens, start), f"{sreq.request_id}: stale KV"
            else:
                prev = _ROOT
            assert prev is not None
            for pos in range(start, end):
                prev = mix(prev, tokens[pos])
                slot = (sreq.block_ids[pos // bs], pos % bs)
                other = written.setdefault(slot, sreq.request_id)
                assert other == sreq.request_id, f"{slot} written by {other} and {sreq.request_id}"
                self.kv[slot[0]][slot[1]] = prev
            self.num_computed_total += end - start
            if sreq.needs_sample:
                assert end == len(tokens), f"{sreq.request_id} samples before its last token"
                token = self.next_token(prev)
                sampled.append(token)
                want = sreq.sampling.logprobs
                logprobs.append(TokenLogprob(token, -0.5) if want is not None else None)
            else:
                assert end < len(tokens), f"{sreq.request_id} skips the sample of its last token"
                sampled.append(None)
                logprobs.append(None)
        return RunnerOutput(sampled, logprobs)


class SimPending:
    """A launched simulated step: the result is computed at launch (stream order), read later."""

    def __init__(self, output: RunnerOutput) -> None:
        self.output = output
        self.num_reads = 0

    def result(self) -> RunnerOutput:
        self.num_reads += 1
        return self.output


class AsyncSimRunner(SimRunner):
    """SimRunner that, like runner V2, keeps each running request's drawn tokens itself.

    A step may be launched before the previous step's tokens reached the scheduler: rows then
    name positions past `token_ids` (`num_pending_tokens` placeholders), whose input tokens come
    from this runner's own copy. Checks that the host's tokens are always a prefix of it, and
    that `is_new` rows (admission, recompute after preemption) bring every token.
    """

    name = "async-sim"
    supports_async_scheduling = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sequences: dict[str, list[int]] = {}
        self.max_pending_seen = 0

    def execute_async(self, out: SchedulerOutput) -> SimPending:
        for request_id in [*out.finished_ids, *out.preempted_ids]:
            self.sequences.pop(request_id, None)
        rows: list[ScheduledRequest] = []
        for sreq in out.scheduled:
            if sreq.is_new:
                assert sreq.num_pending_tokens == 0, f"{sreq.request_id}: new with pending"
                self.sequences[sreq.request_id] = list(sreq.token_ids)
            own = self.sequences[sreq.request_id]
            assert own[: len(sreq.token_ids)] == sreq.token_ids, "host tokens diverged"
            assert len(own) == len(sreq.token_ids) + sreq.num_pending_tokens
            self.max_pending_seen = max(self.max_pending_seen, sreq.num_pending_tokens)
            rows.append(dataclasses.replace(sreq, token_ids=own, num_pending_tokens=0))
        output = super().execute(SchedulerOutput(rows, out.finished_ids, out.preempted_ids))
        for sreq, token in zip(rows, output.sampled_token_ids, strict=True):
            if token is not None:
                sreq.token_ids.append(token)  # drawn into the runner's own state
        return SimPending(output)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.execute_async(out).result()


def make_config(**overrides: Any) -> EngineConfig:
    """A small valid config: blocks of 4 tokens, a 64-token step budget."""
    base = EngineConfig(model="sim", block_size=4, max_num_batched_tokens=64)
    return dataclasses.replace(base, **overrides)


def run_to_completion(
    scheduler: Scheduler, runner: SimRunner, max_steps: int = 10_000
) -> dict[str, list[RequestDelta]]:
    """Step until nothing is unfinished; return every request's deltas in order."""
    deltas: dict[str, list[RequestDelta]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return deltas
        out = scheduler.schedule()
        assert out.scheduled, "the scheduler made no progress with work pending"
        for delta in scheduler.update_from_output(out, runner.execute(out)):
            deltas.setdefault(delta.request_id, []).append(delta)
    raise AssertionError(f"not finished after {max_steps} steps")


def output_tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def reference_outputs(
    requests: list[EngineRequest], max_model_len: int, **runner_kwargs: Any
) -> dict[str, list[int]]:
    """Each request's output when run alone with plenty of blocks and no prefix cache."""
    result: dict[str, list[int]] = {}
    for req in requests:
        config = make_config(enable_prefix_caching=False)
        scheduler = Scheduler(config, num_blocks=4096, max_model_len=max_model_len)
        runner = SimRunner(4096, 4, **runner_kwargs)
        scheduler.add_request(req)
        result[req.request_id] = output_tokens(run_to_completion(scheduler, runner)[req.request_id])
    return result


class SpecSimRunner(AsyncSimRunner):
    """AsyncSimRunner that also verifies drafts, greedily, as runner V2 does.

    A row with `num_spec_tokens` K computes its last token and K drafts (`spec_token_ids`
    padded with token 0, or, for a draft-model row, K drafts this runner proposes: the true
    continuation with every `corrupt_every`-th draft wrong). The K/V of all K + 1 positions are
    written, the drafted ones too; the drafts the target agrees with are accepted, then the
    target's own token. Stale K/V of rejected positions trips the prefix check if the scheduler
    ever lets a later step read them.
    """

    name = "spec-sim"

    def __init__(self, *args: Any, corrupt_every: int = 3, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.corrupt_every = corrupt_every
        self.num_spec_rows = 0
        self.num_proposed = 0

    def execute_async(self, out: SchedulerOutput) -> SimPending:
        plain = [s for s in out.scheduled if not s.num_spec_tokens]
        spec_rows = {s.request_id: s for s in out.scheduled if s.num_spec_tokens}
        inner = SchedulerOutput(plain, out.finished_ids, out.preempted_ids)
        output = super().execute_async(inner).output
        by_id = dict(zip([s.request_id for s in plain], output.sampled_token_ids, strict=True))
        sampled: list[int | None] = []
        spec_tokens: list[list[int] | None] = []
        for sreq in out.scheduled:
            if sreq.num_spec_tokens:
                sampled.append(None)
                spec_tokens.append(self._verify(spec_rows[sreq.request_id]))
            else:
                sampled.append(by_id[sreq.request_id])
                spec_tokens.append(None)
        return SimPending(RunnerOutput(sampled, None, spec_tokens))

    def _verify(self, sreq: ScheduledRequest) -> list[int]:
        assert not sreq.is_new and sreq.num_pending_tokens == 0, sreq
        own = self.sequences[sreq.request_id]
        assert own == sreq.token_ids, "a verifying request's tokens are all on the host"
        bs, k = self.block_size, sreq.num_spec_tokens
        start = sreq.num_computed_tokens
        assert start == len(own) - 1 and sreq.num_new_tokens == k + 1, sreq
        assert len(sreq.block_ids) * bs >= start + k + 1, "no KV slots for the drafts"
        prev = self.kv[sreq.block_ids[(start - 1) // bs]][(start - 1) % bs]
        assert prev == prefix_digest(own, start), f"{sreq.request_id}: stale KV"
        if sreq.spec_token_ids is not None:
            assert len(sreq.spec_token_ids) <= k
            drafts = list(sreq.spec_token_ids) + [0] * (k - len(sreq.spec_token_ids))
            num_real = len(sreq.spec_token_ids)
        else:
            drafts = self._propose(own, prev, k)
            num_real = k
        self.num_spec_rows += 1
        self.num_proposed += num_real
        inputs = [own[start], *drafts]
        emitted: list[int] = []
        accepting = True
        for i, token in enumerate(inputs):
            prev = mix(prev, token)
            pos = start + i
            self.kv[sreq.block_ids[pos // bs]][pos % bs] = prev
            if not accepting:
                continue
            target = self.next_token(prev)
            if i < num_real and drafts[i] == target:
                emitted.append(target)
            else:
                emitted.append(target)
                accepting = False
        self.num_computed_total += k + 1
        own.extend(emitted)
        return emitted

    def _propose(self, own: list[int], digest: int, k: int) -> list[int]:
        """The true continuation with every `corrupt_every`-th draft (by content) wrong."""
        drafts: list[int] = []
        token = own[-1]
        for _ in range(k):
            digest = mix(digest, token)
            token = self.next_token(digest)
            if self.corrupt_every and digest % self.corrupt_every == 0:
                token = (token + 1) % self.vocab_size
            drafts.append(token)
        return drafts
