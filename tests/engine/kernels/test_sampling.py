from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.penalties import apply_penalties
from davit_engine.kernels.sampling import (
    SamplingTable,
    gumbel_reference,
    sample,
    sample_reference,
)


def _table(device: torch.device, **columns: list[float] | list[int]) -> SamplingTable:
    n = len(next(iter(columns.values())))
    defaults: dict[str, list[float] | list[int]] = {
        "temperature": [1.0] * n,
        "top_k": [0] * n,
        "top_p": [1.0] * n,
        "min_p": [0.0] * n,
        "seed": list(range(n)),
    }
    defaults.update(columns)
    return SamplingTable(
        temperature=torch.tensor(defaults["temperature"], device=device),
        top_k=torch.tensor(defaults["top_k"], dtype=torch.int32, device=device),
        top_p=torch.tensor(defaults["top_p"], device=device),
        min_p=torch.tensor(defaults["min_p"], device=device),
        seed=torch.tensor(defaults["seed"], dtype=torch.int32, device=device),
    )


def test_matches_reference_for_every_filter(device: torch.device) -> None:
    torch.manual_seed(0)
    vocab = 3000  # more than one 2048-wide chunk
    table = _table(
        device,
        temperature=[0.0, 1.0, 0.7, 1.0, 1.0, 1.3, 0.5],
        top_k=[0, 0, 5, 0, 10, 3, 1],
        top_p=[1.0, 1.0, 1.0, 0.5, 0.8, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0],
        seed=[1, 2, 3, -4, 5, 6, 7],
    )
    logits = torch.randn(7, vocab, device=device) * 3
    slots = torch.arange(7, dtype=torch.int32, device=device)
    for step in range(3):
        pos = torch.full((7,), 10 + step, dtype=torch.int32, device=device)
        ours = sample(logits, slots, pos, table)
        assert torch.equal(ours, sample_reference(logits, slots, pos, table))
    assert int(ours[0]) == int(torch.argmax(logits[0]))
    assert int(ours[6]) == int(torch.argmax(logits[6]))  # top_k = 1 is greedy


def test_greedy_breaks_ties_like_argmax(device: torch.device) -> None:
    logits = torch.zeros(1, 2500, device=device)
    logits[0, 2100] = 5.0
    logits[0, 2200] = 5.0
    table = _table(device, temperature=[0.0])
    slot = torch.zeros(1, dtype=torch.int32, device=device)
    assert int(sample(logits, slot, slot, table)[0]) == 2100


def test_seeded_draw_ignores_the_batch(device: torch.device) -> None:
    torch.manual_seed(1)
    row = torch.randn(1, 500, device=device)
    table = _table(device, seed=[42, 7, 42])
    pos = torch.full((3,), 9, dtype=torch.int32, device=device)
    alone = sample(row, torch.zeros(1, dtype=torch.int32, device=device), pos[:1], table)
    batch = torch.cat([torch.randn(1, 500, device=device), row, row])
    slots = torch.tensor([1, 0, 2], dtype=torch.int32, device=device)
    together = sample(batch, slots, pos, table)
    assert int(together[1]) == int(alone[0]) == int(together[2])


def test_gumbel_race_follows_the_softmax() -> None:
    """The kernels' noise (checked equal to this reference by the tests above) makes the race
    draw from the softmax: 20,000 seeds over one 4-token distribution."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    seeds = torch.arange(20_000)[:, None]
    noise = gumbel_reference(seeds, torch.tensor(7), torch.arange(4)[None, :])
    winners = torch.argmax(torch.log(probs)[None, :] + noise, dim=1)
    freq = torch.bincount(winners, minlength=4).double() / 20_000
    assert torch.allclose(freq, probs.double(), atol=0.015)


@pytest.mark.gpu
def test_kernel_draws_follow_the_softmax(device: torch.device) -> None:
    # 4000 rows of one 4-token distribution with distinct seeds: frequencies match the softmax.
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4], device=device)).repeat(4000, 1)
    table = _table(device, seed=list(range(4000)))
    slots = torch.arange(4000, dtype=torch.int32, device=device)
    pos = torch.zeros(4000, dtype=torch.int32, device=device)
    counts = torch.bincount(sample(logits, slots, pos, table), minlength=4).double() / 4000
    expected = torch.tensor([0.1, 0.2, 0.3, 0.4], device=device).double()
    assert torch.allclose(counts, expected, atol=0.03)


def test_gumbel_noise_is_uniformly_spread() -> None:
    g = gumbel_reference(torch.tensor(5), torch.tensor(3), torch.arange(100_000))
    u = torch.exp(-torch.exp(-g))  # back to the uniform draw
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(u.var()) - 1 / 12) < 0.01


def test_commit_writes_only_sampling_rows(device: torch.device) -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 100, device=device)
    table = _table(device, temperature=[0.0, 0.0])
    token_table = torch.full((2, 8), -1, dtype=torch.int32, device=device)
    slots = torch.tensor([1, 0], dtype=torch.int32, device=device)
    pos = torch.tensor([3, 5], dtype=torch.int32, device=device)
    needs = torch.tensor([1, 0], dtype=torch.int32, device=device)
    out = sample(logits, slots, pos, table, commit_to=token_table, needs_sample=needs)
    assert int(token_table[1, 3]) == int(out[0])
    assert int((token_table != -1).sum()) == 1


def test_penalties(device: torch.device) -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]], device=device)
    # prompt [0, 1], output [2, 2]; token 3 and 4 never seen
    tokens = torch.tensor([[0, 1, 2, 2, 4, 4]], dtype=torch.int32, device=device)
    one = torch.ones(1, device=device)
    apply_penalties(
        logits,
        tokens,
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.tensor([4], dtype=torch.int32, device=device),
        torch.tensor([2], dtype=torch.int32, device=device),
        2.0 * one,
        0.5 * one,
        0.25 * one,
        6,
    )
    expected = torch.tensor([[1.0, -4.0, 0.5 - 0.5 - 0.5, 0.5, 3.0]], device=device)
    assert torch.allclose(logits, expected)


@pytest.mark.gpu
def test_real_vocab_matches_reference(device: torch.device) -> None:
    torch.manual_seed(3)
    n = 64
    table = _table(
        device,
        temperature=[0.0, 1.0, 0.8, 1.0] * (n // 4),
        top_k=[0, 0, 50, 20] * (n // 4),
        top_p=[1.0, 0.9, 0.95, 1.0] * (n // 4),
        min_p=[0.0, 0.0, 0.05, 0.0] * (n // 4),
        seed=list(range(n)),
    )
    logits = torch.randn(n, 151_936, device=device) * 4
    slots = torch.arange(n, dtype=torch.int32, device=device)
    pos = torch.full((n,), 100, dtype=torch.int32, device=device)
    ours = sample(logits, slots, pos, table)
    ref = sample_reference(logits, slots, pos, table)
    assert float((ours == ref).float().mean()) >= 0.97  # float ulp ties may differ, rarely


def test_table_columns_of_one_strided_tensor(device: torch.device) -> None:
    """Runner V2 keeps the parameters as columns of one [S, C] table: the kernels must read
    slot s's values at s * stride, not at s."""
    torch.manual_seed(4)
    params = torch.zeros(3, 5, device=device)
    params[:, 0] = torch.tensor([0.0, 1.0, 0.0])  # temperature: slot 1 samples, 0 and 2 greedy
    params[:, 2] = 1.0  # top_p off
    as_int = params.view(torch.int32)
    table = SamplingTable(
        temperature=params[:, 0],
        top_k=as_int[:, 1],
        top_p=params[:, 2],
        min_p=params[:, 3],
        seed=as_int[:, 4],
    )
    assert table.stride == 5
    logits = torch.randn(3, 300, device=device)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    pos = torch.full((3,), 4, dtype=torch.int32, device=device)
    out = sample(logits, slots, pos, table, any_filtered=False)
    assert int(out[0]) == int(torch.argmax(logits[0]))
    assert int(out[1]) == int(torch.argmax(logits[1]))
    assert torch.equal(out, sample_reference(logits, slots, pos, table))
