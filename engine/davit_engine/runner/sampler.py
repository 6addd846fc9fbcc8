"""Token sampling in plain torch: penalties, greedy, temperature, top-k/top-p/min-p, seeds, logprobs.

Order of processing, per row: custom logits processors → min_tokens (EOS/stop ids masked) →
repetition, frequency and presence penalties → greedy argmax, or temperature → top-k → top-p →
min-p → a draw. Every stage is one batched tensor operation over the rows that need it.

Logprobs convention: reported logprobs are the log-softmax of the model's raw logits (before
penalties, temperature and truncation), as the upstream engine reports by default, so they do
not depend on the sampling settings.

Seeds: a row with `seed` draws its noise from its own generator seeded by (seed, number of
tokens so far), so its output is the same whatever else is in the batch, and the same again
after a preemption recomputes it. Sampling inverts the cumulative distribution with one
uniform number per row (cheap: no per-token noise over the vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from davit_engine.core.batch import ScheduledRequest
from davit_engine.types import ParamError, TokenLogprob

# A custom logits processor maps (token ids so far: prompt + output, logits [V]) -> logits [V].
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]
_LOGITS_PROCESSORS: dict[str, LogitsProcessor] = {}
_SEED_MIX = 0x9E3779B97F4A7C15
_CDF_CHUNK = 256  # vocabulary entries per chunk of the two-level inverse CDF  # odd 64-bit constant: spreads (seed, step) over the seed space


def register_logits_processor(name: str, processor: LogitsProcessor) -> None:
    """Make `name` usable in `SamplingParams.logits_processors` (runner V1 only)."""
    _LOGITS_PROCESSORS[name] = processor


def unregister_logits_processor(name: str) -> None:
    _LOGITS_PROCESSORS.pop(name, None)


def registered_logits_processors() -> list[str]:
    return sorted(_LOGITS_PROCESSORS)


def check_logits_processors(names: Sequence[str]) -> None:
    for name in names:
        if name not in _LOGITS_PROCESSORS:
            known = ", ".join(sorted(_LOGITS_PROCESSORS)) or "none registered"
            raise ParamError("logits_processors", f"unknown logits processor {name!r} ({known})")


def row_seed(seed: int, num_tokens: int) -> int:
    """The generator seed for a seeded row's draw after `num_tokens` tokens."""
    return (seed * _SEED_MIX + num_tokens) % (1 << 63)


class Sampler:
    """Samples one token per row of logits; `eos_token_ids` are masked while min_tokens holds.

    `sample()` may modify the logits it is given in place (they are the runner's scratch).
    """

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        # logits: [N, V] float32, row i belongs to requests[i]
        num_rows, vocab = logits.shape
        assert num_rows == len(requests)
        params = [r.sampling for r in requests]
        device = logits.device

        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = (
            torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None
        )  # [L, V]

        for i, (req, p) in enumerate(zip(requests, params, strict=True)):
            for name in p.logits_processors:
                logits[i] = _LOGITS_PROCESSORS[name](req.token_ids, logits[i])
        self._apply_min_tokens(logits, requests)
        self._apply_penalties(logits, requests)

        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        # Uniform batches (the common case) skip the row gathers: [N, V] copies are not free.
        if not random_rows:
            sampled = logits.argmax(dim=-1)
        elif not greedy:
            sampled = self._sample_random(logits, requests)
        else:
            sampled = torch.empty(num_rows, dtype=torch.int64, device=device)
            sampled[greedy] = logits[greedy].argmax(dim=-1)
            sampled[random_rows] = self._sample_random(
                logits[random_rows], [requests[i] for i in random_rows]
            )

        token_ids = sampled.tolist()
        logprobs: list[TokenLogprob | None] = [None] * num_rows
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, sampled[want_logprobs].unsqueeze(1)).squeeze(1)
            max_top = max(params[i].logprobs or 0 for i in want_logprobs)
            top_values, top_ids = (
                raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None)
            )  # [L, max_top]
            chosen_list = chosen.tolist()
            top_v = top_values.tolist() if top_values is not None else None
            top_i = top_ids.tolist() if top_ids is not None else None
            for j, row in enumerate(want_logprobs):
                n = params[row].logprobs or 0
                top = (
                    list(zip(top_i[j][:n], top_v[j][:n], strict=True))
                    if n and top_i is not None and top_v is not None
                    else []
                )
                logprobs[row] = TokenLogprob(token_ids[row], chosen_list[j], top)
        return token_ids, logprobs

    def _apply_min_tokens(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, req in enumerate(requests):
            p = req.sampling
            if p.min_tokens and req.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | set(self.eos_token_ids)
                rows.extend([i] * len(banned))
                cols.extend(banned)
        if rows:
            logits[rows, cols] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> None:
        rows = [
            i
            for i, r in enumerate(requests)
            if r.sampling.repetition_penalty != 1.0
            or r.sampling.presence_penalty != 0.0
            or r.sampling.frequency_penalty != 0.0
        ]
        if not rows:
            return
        device = logits.device
        vocab = logits.shape[1]
        sub = logits[rows]  # [R, V]
        # counts[r, t]: occurrences of t among row r's output tokens; seen: in prompt or output.
        counts = torch.zeros_like(sub)
        seen = torch.zeros(sub.shape, dtype=torch.bool, device=device)
        out_rows: list[int] = []
        out_ids: list[int] = []
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        for j, i in enumerate(rows):
            req = requests[i]
            outputs = req.output_token_ids
            out_rows.extend([j] * len(outputs))
            out_ids.extend(outputs)
            prompt = req.token_ids[: req.num_prompt_tokens]
            prompt_rows.extend([j] * len(prompt))
            prompt_ids.extend(prompt)
        if out_ids:
            index = (torch.tensor(out_rows, device=device), torch.tensor(out_ids, device=device))
            counts.index_put_(index, torch.ones(len(out_ids), device=device), accumulate=True)
        if prompt_ids:
            seen[
                torch.tensor(prompt_rows, device=device), torch.tensor(prompt_ids, device=device)
            ] = True
        seen |= counts > 0
        params = [requests[i].sampling for i in rows]
        rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        # Repetition penalty (multiplicative, on prompt and output tokens): shrink positive
        # logits, push negative ones further down.
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        assert sub.shape[1] == vocab
        logits[rows] = sub

    def _sample_random(
        self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]
    ) -> torch.Tensor:
        # logits: [R, V] -> sampled ids [R]
        device = logits.device
        params = [r.sampling for r in requests]
        if any(p.temperature != 1.0 for p in params):
            temperature = torch.tensor([p.temperature for p in params], device=device)
            logits = logits / temperature.unsqueeze(1)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _apply_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            threshold = torch.tensor(min_p, device=device).unsqueeze(1) * probs.amax(
                dim=-1, keepdim=True
            )
            probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        # Inverse-CDF sampling: one uniform number per row instead of one per vocabulary entry.
        uniform = torch.rand(len(requests), 1, device=device)
        for j, req in enumerate(requests):
            seed = req.sampling.seed
            if seed is not None:
                generator = torch.Generator(device=device).manual_seed(
                    row_seed(seed, len(req.token_ids))
                )
                uniform[j] = torch.rand(1, generator=generator, device=device)
        return _inverse_cdf(probs, uniform)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token ids [R] with P(i) = probs[r, i] / sum(probs[r]), from uniform [R, 1] in [0, 1).

    Two levels (chunk masses, then one chunk) instead of a cumulative sum over the whole
    vocabulary: the full-width work is one reduction, which vectorizes well.
    """
    num_rows, vocab = probs.shape
    chunk = _CDF_CHUNK
    num_chunks = -(-vocab // chunk)
    if num_chunks * chunk != vocab:
        probs = torch.nn.functional.pad(probs, (0, num_chunks * chunk - vocab))
    chunks = probs.view(num_rows, num_chunks, chunk)
    mass = chunks.sum(dim=-1)  # [R, C]
    cdf = mass.cumsum(dim=-1)
    # Scaled by the row's total so masked (zero) mass and rounding cannot push u past it.
    target = uniform * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).clamp_max(num_chunks - 1)  # [R, 1]
    # The picked chunk has positive mass; find the token inside it by the mass left over.
    remaining = (target - (cdf.gather(1, picked) - mass.gather(1, picked))).clamp_min(0.0)
    inner = chunks[torch.arange(num_rows, device=probs.device), picked.squeeze(1)]  # [R, chunk]
    inner_cdf = inner.cumsum(dim=-1)
    remaining = torch.minimum(remaining, inner_cdf[:, -1:] * (1 - 1e-6))
    offset = torch.searchsorted(inner_cdf, remaining, right=True).clamp_max(chunk - 1)
    return (picked * chunk + offset).squeeze(1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and outside its top-p nucleus."""
    device = logits.device
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=device).unsqueeze(1)
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token while the mass of the tokens ranked before it is below top_p (so the most
    # likely token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= p) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
