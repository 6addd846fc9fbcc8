"""Runner V2's sampling step: per-request features around the Triton sampling kernel.

Everything stays on the device: min-tokens masking and penalties are tensor operations applied
only when a request in the batch asks for them (the host knows that from the parameters); the
kernel draws and commits the tokens into the state table. Logprobs follow runner V1's
convention (log-softmax of the raw logits) and travel back with the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from davit_engine.core.batch import ScheduledRequest
from davit_engine.kernels.penalties import apply_penalties
from davit_engine.kernels.sampling import sample
from davit_engine.runner.v2.state import RequestStateTable, StepRows


def indices(values: list[int], device: torch.device) -> torch.Tensor:
    """A small index tensor sent without stalling the host (pinned, non-blocking copy)."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass
class LogprobRequest:
    """Device tensors whose host copies become `TokenLogprob`s for `rows`."""

    rows: list[int]
    counts: list[int]  # top-n per row
    chosen: torch.Tensor  # [L] float32: logprob of the drawn token
    top_values: torch.Tensor | None  # [L, n_max]
    top_ids: torch.Tensor | None  # [L, n_max]


def sample_step(
    logits: torch.Tensor,  # [B, V] float32, may be modified in place
    rows: StepRows,  # B real rows
    positions: torch.Tensor,  # [B] int32: position of the drawn token (= seq_len)
    scheduled: Sequence[ScheduledRequest],
    state: RequestStateTable,
    eos_token_ids: Sequence[int],
    max_seq_len: int,
) -> tuple[torch.Tensor, LogprobRequest | None]:
    """Draw (and commit) one token per row; returns the tokens [B] int64 and the logprob work."""
    device = logits.device
    logprob_rows = [i for i, r in enumerate(scheduled) if r.sampling.logprobs is not None]
    logprob_index = indices(logprob_rows, device) if logprob_rows else None
    raw_logprobs = (
        torch.log_softmax(logits[logprob_index], dim=-1) if logprob_index is not None else None
    )

    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for i, req in enumerate(scheduled):
        p = req.sampling
        if p.min_tokens and req.needs_sample and req.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | set(eos_token_ids)
            banned_rows.extend([i] * len(banned))
            banned_ids.extend(banned)
    if banned_rows:
        logits[indices(banned_rows, device), indices(banned_ids, device)] = float("-inf")

    if any(
        r.sampling.repetition_penalty != 1.0
        or r.sampling.presence_penalty != 0.0
        or r.sampling.frequency_penalty != 0.0
        for r in scheduled
    ):
        slots = rows.slot.long()
        apply_penalties(
            logits,
            state.token_ids,
            rows.slot,
            positions,
            state.prompt_len[slots],
            state.repetition[slots],
            state.presence[slots],
            state.frequency[slots],
            max_seq_len,
        )

    vocab_size = logits.shape[1]
    any_filtered = any(
        not r.sampling.is_greedy
        and (0 < r.sampling.top_k < vocab_size or r.sampling.top_p < 1.0 or r.sampling.min_p > 0)
        for r in scheduled
    )
    tokens = sample(
        logits,
        rows.slot,
        positions,
        state.sampling,
        commit_to=state.token_ids,
        needs_sample=rows.needs_sample,
        any_filtered=any_filtered,
    )

    logprobs = None
    if raw_logprobs is not None:
        counts = [scheduled[i].sampling.logprobs or 0 for i in logprob_rows]
        assert logprob_index is not None
        chosen = raw_logprobs.gather(1, tokens[logprob_index].unsqueeze(1)).squeeze(1)
        top_values = top_ids = None
        if max(counts):
            top_values, top_ids = raw_logprobs.topk(max(counts), dim=-1)
        logprobs = LogprobRequest(logprob_rows, counts, chosen, top_values, top_ids)
    return tokens, logprobs
