from __future__ import annotations

import pytest
import torch

from davit_engine.kernels import sampling
from davit_engine.kernels.penalties import apply_penalties
from davit_engine.kernels.sampling import (
    FILTER_PATHS,
    SamplingTable,
    gumbel_reference,
    sample,
    sample_reference,
    sample_with_paths,
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


# Rows with top-k, top-p or min-p: search passes, candidate list, whole-row fallback.


def _small_slices(monkeypatch: pytest.MonkeyPatch, cap: int = 4096, levels: int = 4) -> None:
    """Slices of 256 tokens (so a small vocabulary spans many programs), and the candidate
    list / search depth the test needs."""
    monkeypatch.setattr(sampling, "_SPLIT", 256)
    monkeypatch.setattr(sampling, "_CANDIDATE_CAP", cap)
    monkeypatch.setattr(sampling, "_SEARCH_LEVELS", levels)


def _draw(
    logits: torch.Tensor, table: SamplingTable, position: int = 11
) -> tuple[torch.Tensor, torch.Tensor, list[str], list[int]]:
    """Kernel tokens, reference tokens, each row's path and search passes."""
    n = logits.shape[0]
    slots = torch.arange(n, dtype=torch.int32, device=logits.device)
    pos = torch.full((n,), position, dtype=torch.int32, device=logits.device)
    tokens, paths = sample_with_paths(logits, slots, pos, table)
    assert paths is not None
    names = [FILTER_PATHS[int(p)] for p in paths.path]
    return tokens, sample_reference(logits, slots, pos, table), names, paths.search_passes.tolist()


def test_filtered_rows_over_many_slices_match_reference(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    _small_slices(monkeypatch)
    torch.manual_seed(5)
    vocab = 3000  # 12 slices
    scale = torch.tensor([3.0, 1.0, 3.0, 0.3, 5.0, 1.0, 2.0, 3.0], device=device)
    logits = torch.randn(8, vocab, device=device) * scale[:, None]
    logits[0, :20] += 12.0  # a peaked row: a few tokens hold nearly all the mass
    table = _table(
        device,
        temperature=[1.0, 0.7, 1.3, 1.0, 1.0, 2.0, 1.0, 0.5],
        top_k=[0, 50, 0, 20, 0, 0, 0, 10],
        top_p=[0.9, 1.0, 0.95, 0.5, 0.99, 0.9, 1.0, 0.8],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.1],
        seed=[3, -8, 99, 12345, 7, 0, 2**31 - 1, -(2**31)],
    )
    for position in (0, 11, 500):
        ours, ref, paths, _ = _draw(logits, table, position)
        assert torch.equal(ours, ref), (position, ours.tolist(), ref.tolist())
    assert paths[6] == "threshold"  # min-p alone: its threshold is known from the maximum
    assert set(paths) - {"threshold"} == {"candidates"}


def test_search_narrows_until_the_list_fits(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 32-token list: flat rows need several search passes before their interval fits."""
    _small_slices(monkeypatch, cap=32)
    torch.manual_seed(6)
    logits = torch.randn(4, 3000, device=device)
    table = _table(device, top_k=[0, 20, 0, 25], top_p=[0.9, 0.9, 0.5, 1.0])
    ours, ref, paths, passes = _draw(logits, table)
    assert torch.equal(ours, ref)
    assert paths == ["candidates"] * 4
    assert min(passes) >= 2  # the first pass's thresholds are too coarse for 32 tokens


def test_whole_row_path_when_the_search_cannot_narrow(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows the candidate list cannot hold take the whole-row path, with the same result: top-p
    mass spread over many equal logits (no threshold separates them), and a top-k above the
    list's size."""
    _small_slices(monkeypatch, cap=16, levels=2)
    torch.manual_seed(7)
    logits = torch.round(torch.randn(3, 3000, device=device) * 2)  # integer logits: many ties
    table = _table(device, top_k=[0, 40, 0], top_p=[0.9, 1.0, 0.99], seed=[1, 2, 3])
    for position in (1, 2, 3):
        ours, ref, paths, passes = _draw(logits, table, position)
        assert torch.equal(ours, ref)
        assert paths == ["whole-row"] * 3
    assert passes == [2, 0, 2]  # top_k 40 > 16 is known before any search


def test_top_k_ties_stay_in(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-k keeps every token equal to the k-th largest: 3 tokens at 5 and 10 at 4 with
    top_k 5 keep all 13, and over many seeds every one of them is drawn, nothing else."""
    _small_slices(monkeypatch)
    vocab, n = 400, 100
    row = torch.full((vocab,), -3.0, device=device)
    tops = torch.tensor([5, 300, 399], device=device)
    ties = torch.arange(100, 400, 30, device=device)
    row[tops], row[ties] = 5.0, 4.0
    logits = row.repeat(n, 1)
    table = _table(device, top_k=[5] * n, temperature=[3.0] * n, seed=list(range(n)))
    ours, ref, paths, _ = _draw(logits, table)
    assert torch.equal(ours, ref)
    assert set(paths) == {"candidates"}
    assert set(ours.tolist()) == set(tops.tolist()) | set(ties.tolist())


def test_top_k_at_or_above_the_vocabulary_is_off(device: torch.device) -> None:
    torch.manual_seed(8)
    vocab = 400
    logits = torch.randn(1, vocab, device=device).repeat(4, 1)
    table = _table(device, top_k=[0, vocab, vocab + 10, vocab - 1], seed=[9, 9, 9, 9])
    ours, ref, paths, _ = _draw(logits, table)
    assert torch.equal(ours, ref)
    assert paths[:3] == ["unfiltered"] * 3 and paths[3] == "candidates"
    assert int(ours[1]) == int(ours[2]) == int(ours[0])  # top_k >= V draws like no top-k


def test_min_p_alone_over_top_p_and_inside_the_list(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Min-p alone goes straight to the gather pass; with top-p alone, a min-p threshold above
    the top-p interval decides alone; with top-k and top-p, it cuts the candidate list. Every
    draw keeps p >= min_p * p_max."""
    _small_slices(monkeypatch)
    torch.manual_seed(9)
    temperature = [1.0, 1.0, 1.0, 0.7, 1.0, 1.0, 1.0]
    min_p = [0.05, 0.5, 0.3, 0.9, 0.01, 0.2, 0.3]
    logits = torch.randn(len(min_p), 2000, device=device) * 2
    table = _table(
        device,
        temperature=temperature,
        top_p=[1.0, 1.0, 0.99, 0.99, 0.5, 1.0, 0.99],
        top_k=[0, 0, 0, 0, 0, 30, 100],
        min_p=min_p,
    )
    scaled = logits * (1.0 / torch.tensor(temperature, device=device))[:, None]
    floor = scaled.max(1).values + torch.log(torch.tensor(min_p, device=device))
    for position in range(3):
        ours, ref, paths, _ = _draw(logits, table, position)
        assert torch.equal(ours, ref)
        assert paths[:4] == ["threshold"] * 4 and paths[6] == "candidates"
        assert bool((scaled.gather(1, ours[:, None]).squeeze(1) >= floor).all())


def test_mixed_batch_commits_every_sampling_row(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Filtered and unfiltered rows in one batch, in shuffled slots, committing to the token
    table: each row's draw equals the reference and lands at [slot, position] when asked."""
    _small_slices(monkeypatch)
    torch.manual_seed(10)
    n = 7
    logits = torch.randn(n, 1500, device=device) * 3
    table = _table(
        device,
        temperature=[0.0, 1.0, 1.0, 0.8, 1.0, 0.0, 1.2],
        top_k=[0, 0, 40, 0, 1, 0, 0],
        top_p=[1.0, 1.0, 0.9, 0.95, 1.0, 0.9, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1],
    )
    slots = torch.tensor([4, 0, 6, 2, 5, 1, 3], dtype=torch.int32, device=device)
    pos = torch.tensor([3, 5, 0, 9, 2, 7, 8], dtype=torch.int32, device=device)
    needs = torch.tensor([1, 1, 1, 0, 1, 1, 1], dtype=torch.int32, device=device)
    token_table = torch.full((n, 10), -1, dtype=torch.int32, device=device)
    out = sample(logits, slots, pos, table, commit_to=token_table, needs_sample=needs)
    assert torch.equal(out, sample_reference(logits, slots, pos, table))
    for row in range(n):
        written = int(token_table[int(slots[row]), int(pos[row])])
        assert written == (int(out[row]) if needs[row] else -1)
    assert int((token_table != -1).sum()) == int(needs.sum())


def test_masked_logits_are_never_drawn(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-inf logits (banned tokens) with every filter: never drawn, same draw as the reference,
    also when fewer tokens than top_k remain."""
    _small_slices(monkeypatch)
    torch.manual_seed(11)
    n = 5
    logits = torch.randn(n, 1000, device=device) * 2
    banned = torch.rand(n, 1000, device=device) < 0.8
    banned[4, 10:] = True  # ten tokens left, top_k 50
    logits[banned] = float("-inf")
    table = _table(
        device, top_k=[0, 30, 0, 5, 50], top_p=[0.9, 1.0, 1.0, 0.7, 1.0], min_p=[0, 0, 0.1, 0, 0]
    )
    for position in range(4):
        ours, ref, _, _ = _draw(logits, table, position)
        assert torch.equal(ours, ref)
        assert not bool(banned.gather(1, ours[:, None]).any())


def test_draws_ignore_how_the_vocabulary_is_split(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(12)
    logits = torch.randn(4, 2500, device=device) * 2
    table = _table(device, top_k=[0, 20, 0, 0], top_p=[0.9, 0.8, 1.0, 1.0], min_p=[0, 0, 0.1, 0])
    draws = []
    # (slice, tokens per step in the search and gather programs, candidate list)
    for split, sub, cap in ((128, 128, 4096), (512, 64, 64), (4096, 4096, 4096)):
        monkeypatch.setattr(sampling, "_SPLIT", split)
        monkeypatch.setattr(sampling, "_SUB", sub)
        monkeypatch.setattr(sampling, "_GATHER_SUB", sub)
        monkeypatch.setattr(sampling, "_CANDIDATE_CAP", cap)
        draws.append(_draw(logits, table)[0])
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[1], draws[2])


def test_top_p_keeps_the_smallest_top_set(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """probs 0.4 / 0.3 / 0.2 / 0.1 (among 400 near-zero tokens) with top_p 0.6: only the two
    largest are kept, drawn about 4:3."""
    _small_slices(monkeypatch)
    n = 150
    row = torch.full((400,), -30.0, device=device)
    row[[50, 300, 310, 390]] = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1], device=device))
    table = _table(device, top_p=[0.6] * n, seed=list(range(n)))
    ours, ref, _, _ = _draw(row.repeat(n, 1), table)
    assert torch.equal(ours, ref)
    counts = torch.bincount(ours, minlength=400)
    assert int(counts[50] + counts[300]) == n
    assert abs(float(counts[50]) / n - 4 / 7) < 0.1


def test_real_vocab_default_search(device: torch.device) -> None:
    """The module's own slice, thresholds and list size at a 151,936-token vocabulary: a peaked
    row (a few tokens carry the mass), a randn*3 row and a flat row with top-p 0.9 all end in
    the candidate list, the flat one after the most search passes, and draw the reference's
    token."""
    torch.manual_seed(14)
    vocab = 151_936
    logits = (
        torch.randn(3, vocab, device=device) * torch.tensor([2.5, 3.0, 1.0], device=device)[:, None]
    )
    logits[0, torch.randint(0, vocab, (20,), device=device)] += torch.linspace(
        8, 18, 20, device=device
    )
    table = _table(device, top_p=[0.9, 0.9, 0.9], top_k=[50, 0, 0])
    ours, ref, paths, passes = _draw(logits, table, position=3)
    assert torch.equal(ours, ref)
    assert paths == ["candidates"] * 3
    assert passes[0] == 1 and 1 <= passes[1] <= passes[2] < sampling._SEARCH_LEVELS


@pytest.mark.gpu
def test_real_vocab_filtered_rows_match_reference(device: torch.device) -> None:
    """152k vocabulary, peaked and flat rows, each filter: nearly every draw equals the
    reference (an ulp tie in a float sum may differ, rarely) and no row needs the whole-row
    path."""
    torch.manual_seed(13)
    n = 64
    scales = torch.tensor([4.0, 1.0, 3.0, 0.5] * (n // 4), device=device)
    logits = torch.randn(n, 151_936, device=device) * scales[:, None]
    table = _table(
        device,
        temperature=[1.0, 1.0, 0.7, 1.5] * (n // 4),
        top_k=[0, 50, 0, 0, 0, 0, 200, 0] * (n // 8),
        top_p=[0.9, 0.9, 0.95, 0.99, 1.0, 0.8, 1.0, 0.9] * (n // 8),
        min_p=[0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.1] * (n // 8),
    )
    ours, ref, paths, _ = _draw(logits, table, position=100)
    assert float((ours == ref).float().mean()) >= 0.97
    assert "whole-row" not in paths
