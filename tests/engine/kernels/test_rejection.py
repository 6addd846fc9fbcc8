"""Verification of drafts (kernels/rejection.py): the batched version against its per-row
reference, strict sampled verification against the target distribution on a tiny vocabulary,
greedy's longest-prefix rule, and FLy differing from strict only where its rule allows."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from davit_engine.kernels.rejection import (
    VerifyPolicy,
    VerifyRows,
    target_probs,
    verify_drafts,
    verify_drafts_reference,
)


def make_rows(
    num_rows: int,
    k: int,
    vocab: int,
    gen: torch.Generator,
    *,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> VerifyRows:
    temps = (
        torch.full((num_rows,), temperature)
        if temperature is not None
        else torch.where(
            torch.rand(num_rows, generator=gen) < 0.3,
            0.0,
            0.7 + torch.rand(num_rows, generator=gen),
        )
    )
    return VerifyRows(
        draft=torch.randint(0, vocab, (num_rows, k), generator=gen),
        num_drafts=torch.randint(0, k + 1, (num_rows,), generator=gen),
        position=torch.randint(1, 500, (num_rows,), generator=gen),
        temperature=temps.float(),
        top_k=torch.full((num_rows,), top_k, dtype=torch.int32),
        top_p=torch.full((num_rows,), top_p),
        min_p=torch.full((num_rows,), min_p),
        seed=torch.randint(0, 2**32, (num_rows,), generator=gen),
    )


POLICIES = {
    "strict": VerifyPolicy(),
    "fly": VerifyPolicy("fly", fly_window=1, fly_entropy_threshold=0.3),
    "synthetic-rates": VerifyPolicy("synthetic", synthetic_rates=(0.9, 0.5, 0.2)),
    "synthetic-length": VerifyPolicy("synthetic", synthetic_length=2.5),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("filters", [{}, {"top_k": 4}, {"top_p": 0.8}, {"min_p": 0.1}])
def test_batched_verification_matches_the_reference(policy: str, filters: dict[str, float]) -> None:
    gen = torch.Generator().manual_seed(3)
    num_rows, k, vocab = 24, 3, 11
    rows = make_rows(num_rows, k, vocab, gen, **filters)  # type: ignore[arg-type]
    logits = torch.randn(num_rows, k + 1, vocab, generator=gen) * 2
    # Make drafts right often: copy the argmax into some of them.
    agree = torch.rand(num_rows, k, generator=gen) < 0.6
    rows.draft = torch.where(agree, logits[:, :k].argmax(-1), rows.draft)
    got = verify_drafts(logits, rows, POLICIES[policy], any_filtered=bool(filters))
    want = verify_drafts_reference(logits, rows, POLICIES[policy])
    assert torch.equal(got[1], want[1])
    for s in range(num_rows):
        n = int(want[1][s])
        assert got[0][s, : n + 1].tolist() == want[0][s, : n + 1].tolist(), s
    assert int(got[1].max()) > 0  # some drafts were accepted


def test_greedy_keeps_the_longest_agreeing_prefix_and_one_target_token() -> None:
    vocab, k = 8, 4
    logits = torch.full((3, k + 1, vocab), -5.0)
    target = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [6, 2, 3, 4, 5]])
    logits.scatter_(2, target[:, :, None], 5.0)
    rows = VerifyRows(
        draft=torch.tensor([[1, 2, 7, 4], [1, 2, 3, 4], [1, 2, 3, 4]]),
        num_drafts=torch.tensor([4, 4, 4]),
        position=torch.tensor([10, 10, 10]),
        temperature=torch.zeros(3),
        top_k=torch.zeros(3, dtype=torch.int32),
        top_p=torch.ones(3),
        min_p=torch.zeros(3),
        seed=torch.zeros(3, dtype=torch.int64),
    )
    tokens, n = verify_drafts(logits, rows, VerifyPolicy(), any_random=False, any_filtered=False)
    assert n.tolist() == [2, 4, 0]
    assert tokens[0, :3].tolist() == [1, 2, 3]  # the correction replaces the wrong draft
    assert tokens[1].tolist() == [1, 2, 3, 4, 5]  # all accepted + the bonus token
    assert tokens[2, :1].tolist() == [6]
    # Padding drafts (beyond num_drafts) are never accepted.
    rows.num_drafts = torch.tensor([4, 1, 0])
    _, n = verify_drafts(logits, rows, VerifyPolicy(), any_random=False, any_filtered=False)
    assert n.tolist() == [2, 1, 0]


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.7}])
def test_strict_sampled_verification_reproduces_the_target_distribution(
    filters: dict[str, float],
) -> None:
    """One row, many seeds: the first emitted token follows p0 (the target after the last
    token) whatever the draft, and when the first draft is kept the next token follows p1."""
    vocab, k, trials = 6, 2, 40_000
    logits0 = torch.tensor([1.5, 0.2, 1.0, -0.5, 0.8, 0.0])
    logits1 = torch.tensor([0.1, 1.2, -1.0, 0.9, 0.0, 0.4])
    logits2 = torch.zeros(vocab)
    temperature = 0.9
    gen = torch.Generator().manual_seed(5)
    logits = torch.stack([logits0, logits1, logits2])[None].expand(trials, k + 1, vocab)
    rows = make_rows(trials, k, vocab, gen, temperature=temperature, **filters)  # type: ignore[arg-type]
    rows.draft = torch.tensor([[2, 3]]).expand(trials, k)  # a likely draft, then a plausible one
    rows.num_drafts = torch.full((trials,), k)
    tokens, n = verify_drafts(logits.contiguous(), rows, VerifyPolicy(), any_filtered=bool(filters))

    def probs_of(x: torch.Tensor) -> torch.Tensor:
        one = lambda v: torch.tensor([v])  # noqa: E731
        return target_probs(
            x[None],
            one(temperature),
            one(int(filters.get("top_k", 0))),
            one(float(filters.get("top_p", 1.0))),
            one(0.0),
            True,
        )[0]

    def check(samples: torch.Tensor, p: torch.Tensor) -> None:
        counts = torch.bincount(samples, minlength=vocab).double()
        total = counts.sum()
        for token in range(vocab):
            expected = float(p[token]) * float(total)
            sd = math.sqrt(max(expected * (1 - float(p[token])), 1.0))
            assert abs(float(counts[token]) - expected) < 5 * sd, (token, counts, p * total)

    check(tokens[:, 0], probs_of(logits0))
    kept_first = n >= 1
    assert 0.1 < float(kept_first.double().mean()) < 0.9
    check(tokens[kept_first, 1], probs_of(logits1))


def test_seeded_verification_is_reproducible_and_independent_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(9)
    rows = make_rows(16, 3, 9, gen)
    logits = torch.randn(16, 4, 9, generator=gen)
    first = verify_drafts(logits, rows, VerifyPolicy())
    again = verify_drafts(logits, rows, VerifyPolicy())
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    order = torch.randperm(16, generator=gen)
    shuffled = VerifyRows(
        **{f.name: getattr(rows, f.name)[order] for f in dataclasses.fields(rows)}
    )
    tokens, n = verify_drafts(logits[order], shuffled, VerifyPolicy())
    assert torch.equal(n, first[1][order])
    for j, s in enumerate(order.tolist()):
        count = int(n[j]) + 1
        assert tokens[j, :count].tolist() == first[0][s, :count].tolist()


def test_fly_differs_from_strict_only_where_its_rule_allows() -> None:
    gen = torch.Generator().manual_seed(21)
    num_rows, k, vocab = 400, 4, 7
    rows = make_rows(num_rows, k, vocab, gen)
    rows.num_drafts = torch.full((num_rows,), k)
    logits = torch.randn(num_rows, k + 1, vocab, generator=gen)
    agree = torch.rand(num_rows, k, generator=gen) < 0.7
    rows.draft = torch.where(agree, logits[:, :k].argmax(-1), rows.draft)
    window, threshold = 2, 0.3
    fly = VerifyPolicy("fly", fly_window=window, fly_entropy_threshold=threshold)
    strict_tokens, strict_n = verify_drafts(logits, rows, VerifyPolicy())
    fly_tokens, fly_n = verify_drafts(logits, rows, fly)
    greedy = rows.temperature <= 0
    num_differ = 0
    for s in range(num_rows):
        r = int(strict_n[s])
        same = fly_tokens[s, : int(fly_n[s]) + 1].tolist() == strict_tokens[s, : r + 1].tolist()
        if same:
            continue
        num_differ += 1
        # FLy kept the rejected draft at r: the entropy there is high, the draft possible, and
        # the next `window` drafts were accepted.
        assert int(fly_n[s]) >= r + 1 + window
        assert fly_tokens[s, : r + 1].tolist() == rows.draft[s, : r + 1].tolist()
        t = 1.0 if bool(greedy[s]) else float(rows.temperature[s])
        p = torch.softmax(logits[s, r] / t, dim=-1)
        top = p.topk(3).values
        q = top / top.sum()
        assert float(-(q * q.log()).sum()) > threshold
        assert float(p[rows.draft[s, r]]) > 0
    assert num_differ > 0
    # With an unreachable entropy threshold FLy is strict.
    never = VerifyPolicy("fly", fly_window=window, fly_entropy_threshold=100.0)
    tokens, n = verify_drafts(logits, rows, never)
    assert torch.equal(n, strict_n)
