"""A launched runner-V2 step whose sampled tokens are still on their way to the host."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from davit_engine.core.batch import RunnerOutput
from davit_engine.runner.v2.sampler import LogprobRequest
from davit_engine.types import TokenLogprob


@dataclass
class PendingStep:
    """A launched step. `result()` waits for its sampled tokens (the step's only sync)."""

    num_rows: int
    needs_sample: list[bool]
    host_tokens: torch.Tensor | None = None  # pinned [>= num_rows] int64
    event: torch.cuda.Event | None = None
    logprobs: LogprobRequest | None = None
    # Verifying rows (indices into the step's rows) and their verdicts: pinned [>= S, K + 2]
    # int64, each row's K + 1 tokens then the number of drafts accepted.
    spec_rows: list[int] = field(default_factory=list)
    host_spec: torch.Tensor | None = None
    _done: RunnerOutput | None = field(default=None, repr=False)

    def keep_tokens(self) -> None:
        """Wait for this step's copies to the host and keep them out of the runner's shared
        pinned buffers, which a later step may then reuse. Reads no token, so a step whose
        result is never read (discarded after a failure) cannot fail here."""
        if self._done is not None:
            return
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        if self.host_tokens is not None:
            self.host_tokens = self.host_tokens[: self.num_rows].clone()
        if self.host_spec is not None:
            self.host_spec = self.host_spec[: len(self.spec_rows)].clone()

    def result(self) -> RunnerOutput:
        if self._done is not None:
            return self._done
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host_tokens[: self.num_rows].tolist() if self.host_tokens is not None else []
        sampled: list[int | None] = [
            t if needs else None for t, needs in zip(tokens, self.needs_sample, strict=True)
        ]
        spec_token_ids: list[list[int] | None] | None = None
        if self.spec_rows and self.host_spec is not None:
            spec_token_ids = [None] * self.num_rows
            verdicts = self.host_spec[: len(self.spec_rows)].tolist()
            for row, verdict in zip(self.spec_rows, verdicts, strict=True):
                num_accepted = verdict[-1]
                spec_token_ids[row] = verdict[: num_accepted + 1]
                sampled[row] = None
        logprobs: list[TokenLogprob | None] | None = None
        if self.logprobs is not None:
            logprobs = [None] * self.num_rows
            lp = self.logprobs
            chosen = lp.chosen.tolist()
            top_v = lp.top_values.tolist() if lp.top_values is not None else None
            top_i = lp.top_ids.tolist() if lp.top_ids is not None else None
            for j, row in enumerate(lp.rows):
                token = sampled[row]
                if token is None:
                    continue
                n = lp.counts[j]
                top = (
                    list(zip(top_i[j][:n], top_v[j][:n], strict=True))
                    if n and top_i is not None and top_v is not None
                    else []
                )
                logprobs[row] = TokenLogprob(token, chosen[j], top)
        self._done = RunnerOutput(
            sampled_token_ids=sampled, logprobs=logprobs, spec_token_ids=spec_token_ids
        )
        return self._done
