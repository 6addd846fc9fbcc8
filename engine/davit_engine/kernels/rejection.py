"""Verification of draft tokens against the target's distributions (speculative decoding).

A verifying row brings its target logits at K + 1 positions: after its last token and after each
of its K drafts. Drafts are proposed deterministically (n-gram lookup, the draft model's argmax),
so the draft distribution q is one-hot at the draft token d, and rejection sampling reduces to:
accept d with probability p(d) (the target's probability, after temperature, top-k, top-p and
min-p); at the first rejection draw from the residual max(p - q, 0), which is p without d; when
every draft is accepted, draw a bonus token from p at the last position. The emitted tokens
then follow the target's distribution exactly. Greedy rows (temperature 0 or top-k 1) accept a
draft iff it is the target's argmax, and end with the argmax.

Randomness is the sampling kernel's counter-based hash of (request seed, position, token id), so
a row's outcome depends only on its own seed and positions: never on the batch. The bonus draw
uses the very noise a plain decode at that position would use; the acceptance tests and the
residual draw use salted seeds.

Lossy policies (only when configured, and always reported as such):
- FLy: at the first rejection, if the target's top-k entropy there exceeds a threshold, the
  draft has non-zero target probability and the next `window` drafts would all be accepted,
  the draft is kept and verification continues after it (one such rejection per step);
- synthetic: drafts are accepted at configured per-position rates (or up to a configured mean
  length) whatever the target says; the step ends with a target draw, as after a full accept.

`verify_drafts` runs batched on the device with no host synchronisation (torch operations, a
handful of launches per step); `verify_drafts_reference` is the plain per-row twin the tests
compare it against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from davit_engine.kernels.sampling import gumbel_reference

VerifyMethod = Literal["strict", "fly", "synthetic"]
# Seed salts: acceptance uniforms and residual draws must not reuse a plain decode's noise.
_ACCEPT_SALT = 0x3C6EF372
_RESIDUAL_SALT = 0x2545F491
_ACCEPT_INDEX = 0x7FFFFFF1  # the "token id" hashed for an acceptance uniform


@dataclass(frozen=True)
class VerifyPolicy:
    """How drafts are accepted. `strict` is lossless; `fly` and `synthetic` are not."""

    method: VerifyMethod = "strict"
    fly_window: int = 0
    fly_entropy_threshold: float = 0.3
    fly_entropy_top_k: int = 3
    synthetic_rates: tuple[float, ...] | None = None
    synthetic_length: float | None = None

    def synthetic_acceptance(self, k: int) -> list[float]:
        """Per-position acceptance probabilities of `synthetic` for K drafts (conditional on
        the drafts before being accepted)."""
        if self.synthetic_rates is not None:
            return list(self.synthetic_rates[:k]) + [0.0] * (k - len(self.synthetic_rates))
        length = (self.synthetic_length or 1.0) - 1.0  # drafts accepted on average
        whole, frac = int(math.floor(length)), length - math.floor(length)
        return [1.0 if i < whole else (frac if i == whole else 0.0) for i in range(k)]


@dataclass
class VerifyRows:
    """Per-row inputs of a verification, device tensors of S rows."""

    draft: torch.Tensor  # [S, K] int64: draft tokens (entries past num_drafts are ignored)
    num_drafts: torch.Tensor  # [S] int64: real drafts, 0..K
    position: torch.Tensor  # [S] int64: position of the first draft (last token's + 1)
    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int32, 0 = off
    top_p: torch.Tensor  # [S] float32, 1 = off
    min_p: torch.Tensor  # [S] float32, 0 = off
    seed: torch.Tensor  # [S] int64 (low 32 bits used)


def _uniform(seed: torch.Tensor, pos: torch.Tensor, idx: int | torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) from the sampling hash (the Gumbel noise inverted)."""
    index = idx if isinstance(idx, torch.Tensor) else torch.tensor(idx, device=pos.device)
    return torch.exp(-torch.exp(-gumbel_reference(seed, pos, index)))


def target_probs(
    logits: torch.Tensor,  # [R, V] float32
    temperature: torch.Tensor,  # [R]; 0 (greedy) is treated as 1
    top_k: torch.Tensor,  # [R]
    top_p: torch.Tensor,  # [R]
    min_p: torch.Tensor,  # [R]
    filtered: bool,
) -> torch.Tensor:  # [R, V] float32
    """The target's sampling distribution per row: softmax of `x * (1 / T)` over the tokens
    top-k, top-p (within the top-k set) and min-p keep, as the sampling kernel defines them.
    `filtered=False` (no row has a filter) skips the sort."""
    inv_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).reciprocal()
    y = logits * inv_t[:, None]
    if filtered:
        vocab = y.shape[1]
        ordered, _ = torch.sort(y, dim=1, descending=True)
        k = top_k.long()
        use_k = (k > 0) & (k < vocab)
        kth = ordered.gather(1, (k - 1).clamp(0, vocab - 1)[:, None]).squeeze(1)
        neg_inf = torch.full_like(kth, float("-inf"))
        thr = torch.where(use_k, kth, neg_inf)
        masked = torch.where(ordered >= thr[:, None], ordered, float("-inf"))
        probs = torch.softmax(masked, dim=1)
        before = probs.cumsum(1) - probs  # mass strictly above each rank
        num_kept = (before < top_p[:, None]).sum(1).clamp(1, vocab)
        thr_p = ordered.gather(1, (num_kept - 1)[:, None]).squeeze(1)
        thr = torch.maximum(thr, torch.where(top_p < 1.0, thr_p, neg_inf))
        safe_min_p = torch.where(min_p > 0, min_p, torch.ones_like(min_p))
        thr_min = ordered[:, 0] + torch.log(safe_min_p)
        thr = torch.maximum(thr, torch.where(min_p > 0, thr_min, neg_inf))
        y = torch.where(y >= thr[:, None], y, float("-inf"))
    return torch.softmax(y, dim=1)


def _topk_entropy(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Entropy (nats) of the k most likely tokens, renormalised: [..., V] -> [...]."""
    top = probs.topk(min(k, probs.shape[-1]), dim=-1).values
    q = top / top.sum(-1, keepdim=True).clamp_min(1e-30)
    return -(q * torch.log(q.clamp_min(1e-30))).sum(-1)


def _run_lengths(accept: torch.Tensor) -> torch.Tensor:
    """[S, K] bool -> [S, K + 1] int64: consecutive accepts starting at each position."""
    num_rows, k = accept.shape
    runs = torch.zeros(num_rows, k + 1, dtype=torch.int64, device=accept.device)
    for j in range(k - 1, -1, -1):
        runs[:, j] = accept[:, j].long() * (1 + runs[:, j + 1])
    return runs


def verify_drafts(
    logits: torch.Tensor,  # [S, K + 1, V] float32
    rows: VerifyRows,
    policy: VerifyPolicy,
    any_random: bool = True,
    any_filtered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every row's drafts; returns (tokens [S, K + 1] int64, num_accepted [S] int64):
    row s emits `tokens[s, : num_accepted[s] + 1]` (accepted drafts, then the target's token).

    `any_random=False` promises that every row is greedy, `any_filtered=False` that no row has
    top-k, top-p or min-p: both only skip work.
    """
    num_rows, k_plus_1, vocab = logits.shape
    k = k_plus_1 - 1
    device = logits.device
    draft = rows.draft
    greedy = (rows.temperature <= 0) | (rows.top_k == 1)
    argmax = logits.argmax(-1)  # [S, K + 1]
    offsets = torch.arange(k_plus_1, device=device)
    valid = offsets[:k][None, :] < rows.num_drafts[:, None]
    seed = rows.seed.long()
    needs_probs = any_random or policy.method == "fly"
    probs = None
    if needs_probs:
        # Greedy rows get their plain softmax (FLy's entropy), never a filter.
        flat = lambda t: t[:, None].expand(num_rows, k_plus_1).reshape(-1)  # noqa: E731
        off_k = torch.where(greedy, torch.zeros_like(rows.top_k), rows.top_k)
        off_p = torch.where(greedy, torch.ones_like(rows.top_p), rows.top_p)
        off_min = torch.where(greedy, torch.zeros_like(rows.min_p), rows.min_p)
        probs = target_probs(
            logits.reshape(-1, vocab),
            flat(rows.temperature),
            flat(off_k),
            flat(off_p),
            flat(off_min),
            any_filtered,
        ).view(num_rows, k_plus_1, vocab)

    if policy.method == "synthetic":
        rates = torch.tensor(policy.synthetic_acceptance(k), device=device)
        u = _uniform(seed[:, None] ^ _ACCEPT_SALT, rows.position[:, None] + offsets[:k], 1)
        accept = (u < rates[None, :]) & valid
    else:
        accept = argmax[:, :k] == draft
        if any_random:
            assert probs is not None
            p_draft = probs[:, :k].gather(2, draft[:, :, None]).squeeze(2)
            u = _uniform(
                seed[:, None] ^ _ACCEPT_SALT, rows.position[:, None] + offsets[:k], _ACCEPT_INDEX
            )
            accept = torch.where(greedy[:, None], accept, u < p_draft)
        accept &= valid
    runs = _run_lengths(accept)
    num_accepted = runs[:, 0]
    if policy.method == "fly" and k >= 2:
        assert probs is not None
        r = num_accepted  # first rejection
        p_rejected = probs.gather(1, r[:, None, None].expand(num_rows, 1, vocab)).squeeze(1)
        entropy = _topk_entropy(p_rejected, policy.fly_entropy_top_k)
        draft_at_r = draft.gather(1, r.clamp(max=k - 1)[:, None])
        p_draft_r = p_rejected.gather(1, draft_at_r).squeeze(1)
        after = runs.gather(1, (r + 1).clamp(max=k)[:, None]).squeeze(1)
        forgive = (
            (r < rows.num_drafts)
            & (entropy > policy.fly_entropy_threshold)
            & (p_draft_r > 0)
            & (after >= policy.fly_window)
        )
        num_accepted = torch.where(forgive, r + 1 + after, num_accepted)

    n = num_accepted
    final = argmax.gather(1, n[:, None]).squeeze(1)
    if any_random:
        assert probs is not None
        p_final = probs.gather(1, n[:, None, None].expand(num_rows, 1, vocab)).squeeze(1)
        rejected = n < rows.num_drafts
        if policy.method != "synthetic":
            # The residual after a rejection: p without the rejected draft.
            rejected_draft = draft.gather(1, n.clamp(max=max(k - 1, 0))[:, None])
            drop = torch.zeros_like(p_final, dtype=torch.bool).scatter_(1, rejected_draft, True)
            p_final = torch.where(drop & rejected[:, None], torch.zeros_like(p_final), p_final)
        else:
            rejected = torch.zeros_like(rejected)
        pos = (rows.position + n)[:, None]
        row_seed = torch.where(rejected, seed ^ _RESIDUAL_SALT, seed)[:, None]
        noise = gumbel_reference(row_seed, pos, torch.arange(vocab, device=device)[None, :])
        drawn = (torch.log(p_final) + noise).argmax(1)
        final = torch.where(greedy, final, drawn)
    tokens = torch.cat([draft, torch.zeros_like(draft[:, :1])], dim=1)
    tokens.scatter_(1, n[:, None], final[:, None])
    return tokens, n


def verify_drafts_reference(
    logits: torch.Tensor, rows: VerifyRows, policy: VerifyPolicy
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain per-row twin of `verify_drafts` (same noise, same rules, written step by step)."""
    num_rows, k_plus_1, vocab = logits.shape
    k = k_plus_1 - 1
    tokens = torch.zeros(num_rows, k_plus_1, dtype=torch.int64)
    counts = torch.zeros(num_rows, dtype=torch.int64)
    ids = torch.arange(vocab)
    for s in range(num_rows):
        temperature = float(rows.temperature[s])
        greedy = temperature <= 0 or int(rows.top_k[s]) == 1
        t = torch.tensor([1.0 if greedy else temperature])
        probs = target_probs(
            logits[s].cpu(),
            t.expand(k_plus_1),
            torch.tensor([0 if greedy else int(rows.top_k[s])]).expand(k_plus_1),
            torch.tensor([1.0 if greedy else float(rows.top_p[s])]).expand(k_plus_1),
            torch.tensor([0.0 if greedy else float(rows.min_p[s])]).expand(k_plus_1),
            True,
        )
        seed = torch.tensor(int(rows.seed[s]))
        position = int(rows.position[s])
        num_drafts = int(rows.num_drafts[s])
        drafts = [int(d) for d in rows.draft[s]]

        # Each position's test depends only on its own logits and noise: decide all first.
        accepted = []
        for i in range(k):
            u_pos = torch.tensor(position + i)
            if i >= num_drafts:
                ok = False
            elif policy.method == "synthetic":
                rate = policy.synthetic_acceptance(k)[i]
                ok = float(_uniform(seed ^ _ACCEPT_SALT, u_pos, 1)) < rate
            elif greedy:
                ok = int(probs[i].argmax()) == drafts[i]
            else:
                u = float(_uniform(seed ^ _ACCEPT_SALT, u_pos, _ACCEPT_INDEX))
                ok = u < float(probs[i, drafts[i]])
            accepted.append(ok)
        accepted.append(False)  # nothing to accept after the last draft

        n = 0
        while accepted[n]:
            n += 1
        if policy.method == "fly" and k >= 2 and n < num_drafts:
            window = range(n + 1, n + 1 + policy.fly_window)
            window_ok = all(j < k and accepted[j] for j in window)
            entropy = float(_topk_entropy(probs[n], policy.fly_entropy_top_k))
            if (
                window_ok
                and entropy > policy.fly_entropy_threshold
                and float(probs[n, drafts[n]]) > 0
            ):
                n += 1
                while accepted[n]:
                    n += 1
        rejected = n < num_drafts and policy.method != "synthetic"
        if greedy:
            final = int(logits[s, n].argmax())
        else:
            p = probs[n].clone()
            if rejected:
                p[drafts[n]] = 0.0
            row_seed = seed ^ _RESIDUAL_SALT if rejected else seed
            noise = gumbel_reference(row_seed, torch.tensor(position + n), ids)
            final = int((torch.log(p) + noise).argmax())
        tokens[s, :n] = torch.tensor(drafts[:n], dtype=torch.int64)
        tokens[s, n] = final
        counts[s] = n
    return tokens, counts
