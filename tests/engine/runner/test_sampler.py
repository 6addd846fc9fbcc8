"""The torch sampler: masks, penalties, seeds independent of the batch, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from davit_engine.core.batch import ScheduledRequest
from davit_engine.runner.sampler import (
    Sampler,
    _inverse_cdf,
    check_logits_processors,
    register_logits_processor,
    unregister_logits_processor,
)
from davit_engine.types import ParamError, SamplingParams

VOCAB = 32


def request(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    rid: str = "r",
) -> ScheduledRequest:
    prompt = prompt if prompt is not None else [1, 2, 3]
    tokens = prompt + (output or [])
    return ScheduledRequest(
        request_id=rid,
        token_ids=tokens,
        num_prompt_tokens=len(prompt),
        num_computed_tokens=len(tokens) - 1,
        num_new_tokens=1,
        block_ids=[0],
        sampling=params,
        needs_sample=True,
    )


def logits_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_takes_the_argmax() -> None:
    logits = torch.stack([logits_row(0), logits_row(1)])
    tokens, _ = Sampler(()).sample(logits, [request(SamplingParams(temperature=0.0))] * 2)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    sampler = Sampler(())
    seeded = request(SamplingParams(temperature=1.0, seed=1234), rid="seeded")
    alone, _ = sampler.sample(logits_row(3).unsqueeze(0), [seeded])
    others = [request(SamplingParams(temperature=1.0), rid=f"o{i}") for i in range(5)]
    batch_logits = torch.stack(
        [logits_row(i + 10) for i in range(2)]
        + [logits_row(3)]
        + [logits_row(i + 20) for i in range(3)]
    )
    batch = others[:2] + [seeded] + others[2:]
    for _ in range(3):  # unseeded neighbours draw different noise every time
        tokens, _ = sampler.sample(batch_logits, batch)
        assert tokens[2] == alone[0]


def test_seed_draws_vary_with_position_and_follow_the_distribution() -> None:
    sampler = Sampler(())
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3))
    logits = probs.clamp_min(1e-30).log().unsqueeze(0)
    counts = torch.zeros(VOCAB)
    for step in range(600):
        req = request(SamplingParams(temperature=1.0, seed=7), output=[0] * step)
        (token,), _ = sampler.sample(logits, [req])
        counts[token] += 1
    freq = counts / counts.sum()
    assert counts[3:].sum() == 0
    assert torch.allclose(freq[:3], probs[:3], atol=0.07)


def test_top_k_keeps_only_the_k_best() -> None:
    sampler = Sampler(())
    logits = logits_row(5).unsqueeze(0).repeat(200, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    tokens, _ = sampler.sample(logits, [request(SamplingParams(temperature=2.0, top_k=3))] * 200)
    assert set(tokens) <= top3 and len(set(tokens)) == 3


def test_top_p_keeps_the_smallest_nucleus() -> None:
    sampler = Sampler(())
    probs = torch.tensor([0.45, 0.3, 0.15, 0.1] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-30).log().unsqueeze(0).repeat(300, 1)
    # top_p=0.7: 0.45 alone is not enough, 0.45+0.3 is: exactly tokens {0, 1} remain.
    tokens, _ = sampler.sample(logits, [request(SamplingParams(top_p=0.7))] * 300)
    assert set(tokens) == {0, 1}


def test_min_p_drops_tokens_below_the_scaled_maximum() -> None:
    sampler = Sampler(())
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-30).log().unsqueeze(0).repeat(300, 1)
    # min_p=0.2: threshold 0.1, so token 3 (0.08) goes and tokens 0..2 stay.
    tokens, _ = sampler.sample(logits, [request(SamplingParams(min_p=0.2))] * 300)
    assert set(tokens) == {0, 1, 2}


def test_penalties_change_exactly_the_seen_tokens() -> None:
    sampler = Sampler(())
    logits = torch.linspace(-2, 2, VOCAB).unsqueeze(0)
    # Prompt token 1 (negative logit), outputs 30 twice and 31 once (positive logits).
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    req = request(params, prompt=[1], output=[30, 30, 31])
    processed = logits.clone()
    sampler._apply_penalties(processed, [req])
    out = processed[0]
    raw = logits[0]
    assert out[1] == pytest.approx(raw[1].item() * 2.0)  # prompt only: repetition penalty
    assert out[30] == pytest.approx(raw[30].item() / 2.0 - 0.5 * 2 - 0.25)
    assert out[31] == pytest.approx(raw[31].item() / 2.0 - 0.5 * 1 - 0.25)
    untouched = [i for i in range(VOCAB) if i not in (1, 30, 31)]
    assert torch.equal(out[untouched], raw[untouched])


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    sampler = Sampler(eos_token_ids=(5,))
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 5] = 10.0
    logits[0, 6] = 9.0
    logits[0, 7] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(6,), max_tokens=4)
    # sample() may change its logits in place: each call gets its own copy.
    (token,), _ = sampler.sample(logits.clone(), [request(params, output=[0])])
    assert token == 7
    (token,), _ = sampler.sample(logits.clone(), [request(params, output=[0, 0])])
    assert token == 5


def test_logprobs_are_raw_log_softmax_with_top_n() -> None:
    sampler = Sampler(())
    logits = torch.stack([logits_row(8), logits_row(9)])
    reqs = [
        request(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5), output=[4]),
        request(SamplingParams(temperature=0.0)),
    ]
    tokens, logprobs = sampler.sample(logits.clone(), reqs)
    assert logprobs[1] is None
    first = logprobs[0]
    assert first is not None
    expected = torch.log_softmax(logits[0], dim=-1)
    assert first.token_id == tokens[0]
    assert first.logprob == pytest.approx(expected[tokens[0]].item(), abs=1e-6)
    values, ids = expected.topk(3)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert math.fsum(math.exp(lp) for lp in expected.tolist()) == pytest.approx(1.0, abs=1e-5)


def test_two_level_inverse_cdf_hits_only_positive_mass() -> None:
    # Vocabulary not a multiple of the chunk size; mass in a few scattered tokens.
    vocab = 1000
    probs = torch.zeros(4, vocab)
    probs[:, [3, 511, 512, 999]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    uniform = torch.tensor([[0.0], [0.15], [0.55], [0.999999]])
    assert _inverse_cdf(probs, uniform).tolist() == [3, 511, 512, 999]
    draws = _inverse_cdf(probs.repeat(2500, 1), torch.rand(10000, 1))
    freq = torch.bincount(draws, minlength=vocab).float() / draws.numel()
    assert set(torch.nonzero(freq).flatten().tolist()) == {3, 511, 512, 999}
    assert torch.allclose(freq[[3, 511, 512, 999]], torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03)


def test_custom_logits_processor_runs_and_unknown_names_are_refused() -> None:
    def ban_token_zero(_ids: object, row: torch.Tensor) -> torch.Tensor:
        row[0] = float("-inf")
        return row

    register_logits_processor("test-ban-zero", ban_token_zero)
    try:
        logits = torch.zeros(1, VOCAB)
        logits[0, 0] = 5.0
        params = SamplingParams(temperature=0.0, logits_processors=("test-ban-zero",))
        (token,), _ = Sampler(()).sample(logits, [request(params)])
        assert token != 0
        check_logits_processors(["test-ban-zero"])
    finally:
        unregister_logits_processor("test-ban-zero")
    with pytest.raises(ParamError) as err:
        check_logits_processors(["nope"])
    assert err.value.param == "logits_processors"
