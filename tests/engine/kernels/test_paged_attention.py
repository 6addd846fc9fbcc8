from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from davit_engine.kernels.paged_attention import (
    default_num_splits,
    paged_attention,
    paged_attention_reference,
)
from davit_engine.layers.fp8 import hadamard
from tests.engine.kernels.fp8_cases import rel_err as _rel_err


def _batch(
    device: torch.device,
    q_lens: list[int],
    seq_lens: list[int],
    heads: tuple[int, int],
    dim: int,
    page: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    num_q_heads, num_kv_heads = heads
    max_blocks = max(-(-s // page) for s in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    cache = torch.randn(2, num_blocks, page, num_kv_heads, dim, device=device).to(dtype)
    perm = torch.randperm(num_blocks, device=device)[: len(seq_lens) * max_blocks]
    block_tables = perm.view(len(seq_lens), max_blocks).int()
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=device)
    qsl[1:] = torch.tensor(q_lens, device=device).cumsum(0)
    # q as a strided view of a fused qkv projection
    qkv = torch.randn(sum(q_lens), num_q_heads + 2 * num_kv_heads, dim, device=device).to(dtype)
    q = qkv[:, :num_q_heads]
    return q, cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl


CASES = [
    # (q_lens, seq_lens): decode rows, prefill from scratch, prefill over a cached prefix, mixed
    ([1, 1, 1], [1, 9, 40]),
    ([5, 17], [5, 17]),
    ([6, 3], [30, 11]),
    ([1, 7, 1, 12], [33, 7, 2, 50]),
]


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (2, 2)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_matches_reference(
    device: torch.device,
    q_lens: list[int],
    seq_lens: list[int],
    heads: tuple[int, int],
    num_splits: int,
) -> None:
    torch.manual_seed(sum(seq_lens) + num_splits)
    q, cache, tables, lens, qsl = _batch(device, q_lens, seq_lens, heads, 16, 4, torch.float32)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, cache, tables, lens, qsl, max(q_lens), 0.25, num_splits, out=out)
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.25)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < 1e-5


def test_paged_attention_fp16(device: torch.device) -> None:
    torch.manual_seed(3)
    q, cache, tables, lens, qsl = _batch(device, [1, 9], [20, 9], (4, 2), 32, 8, torch.float16)
    out = paged_attention(q, cache, tables, lens, qsl, 9, 0.2)
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.2)
    assert _rel_err(out, ref) < 3e-3


def test_padding_rows_without_blocks_give_zeros(device: torch.device) -> None:
    torch.manual_seed(4)
    q, cache, tables, lens, qsl = _batch(device, [1, 1], [5, 1], (2, 1), 16, 4, torch.float32)
    tables[1] = -1  # a CUDA-graph padding row: no block at all
    out = paged_attention(q, cache, tables, lens, qsl, 1, 0.3, num_splits=2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = paged_attention_reference(q[:1], cache, tables[:1], lens[:1], qsl[:2], 0.3)
    assert _rel_err(out[:1], ref) < 1e-5


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """A CUDA device of 132 multiprocessors (an H100/H200), for the split choice alone."""
    from davit_engine.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "multiprocessors", lambda device: 132)
    return torch.device("cuda")


def test_default_num_splits(h200: torch.device) -> None:
    gpu = h200
    assert default_num_splits(1, 8, 1280, gpu) == 16  # capped
    assert default_num_splits(1, 8, 300, gpu) == 10  # one split per 32-key tile
    assert default_num_splits(1, 8, 5, gpu) == 1
    # The interpreter runs programs one after another: splits would only add the merge.
    assert default_num_splits(1, 8, 1280, torch.device("cpu")) == 1
    assert default_num_splits(16, 8, 100_000, gpu) == 9  # 128 programs -> ~8 per multiprocessor
    assert default_num_splits(90, 8, 2048, gpu) == 2  # 720 programs
    assert default_num_splits(132, 8, 2048, gpu) == 1  # 1,056 programs already
    assert default_num_splits(256, 8, 4096, gpu) == 1
    # FP8: two waves of its tile (8 programs per multiprocessor), 2,112 programs: twice bf16's
    fp8 = [default_num_splits(r, 8, 2048, gpu, fp8=True) for r in (1, 16, 90, 132, 256)]
    assert fp8 == [16, 16, 3, 2, 2]


def test_split_targets_follow_the_device_and_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Targets are waves of the decode tile's programs on the device's multiprocessors."""
    from davit_engine.kernels import paged_attention as pa

    gpu = torch.device("cuda")
    monkeypatch.setattr(pa, "multiprocessors", lambda device: 66)
    assert pa.split_target_programs(gpu) == 528
    assert pa.split_target_programs(gpu, fp8=True) == 1056
    assert default_num_splits(66, 8, 2048, gpu) == 1  # one target's worth on half the GPU
    assert default_num_splits(45, 8, 2048, gpu) == 2
    assert default_num_splits(66, 8, 2048, gpu, fp8=True) == 2
    monkeypatch.setattr(pa, "SPLIT_WAVES", {"model": 2.0, "fp8": 1.0})
    assert pa.split_target_programs(gpu, fp8=True) == 528
    assert default_num_splits(66, 8, 2048, gpu, fp8=True) == 1


def test_split_past_a_full_wave(monkeypatch: pytest.MonkeyPatch, h200: torch.device) -> None:
    """`SPLIT_PAST_FULL_WAVE`: programs past the target by up to a quarter split in two; fewer
    or more, and a horizon of one key tile, as before."""
    from davit_engine.kernels import paged_attention as pa

    gpu = h200
    assert default_num_splits(144, 8, 2048, gpu) == 1
    monkeypatch.setattr(pa, "SPLIT_PAST_FULL_WAVE", True)
    assert default_num_splits(144, 8, 2048, gpu) == 2  # 1,152 programs
    assert default_num_splits(165, 8, 2048, gpu) == 2  # 1,320: a quarter past
    assert default_num_splits(166, 8, 2048, gpu) == 1
    assert default_num_splits(132, 8, 2048, gpu) == 1  # exactly the target
    assert default_num_splits(90, 8, 2048, gpu) == 2  # below the target: the target's rule
    assert default_num_splits(144, 8, 20, gpu) == 1  # one key tile


def test_balanced_splits_leave_room_for_long_requests(
    monkeypatch: pytest.MonkeyPatch, h200: torch.device
) -> None:
    """`BALANCE_SPLITS`: grids of twice the balanced target's programs over the step's (3 waves
    of 8 per multiprocessor with FP8, of 4 with bf16), one request as before, the horizon and
    the cap still bound."""
    from davit_engine.kernels import paged_attention as pa

    gpu = h200
    monkeypatch.setattr(pa, "BALANCE_SPLITS", True)
    assert pa.balanced_split_programs(gpu, fp8=True) == 3168
    assert default_num_splits(128, 8, 2048, gpu, fp8=True) == 7  # 2 x 3,168 / 1,024
    assert default_num_splits(256, 8, 2048, gpu, fp8=True) == 4
    assert default_num_splits(256, 8, 2048, gpu) == 2  # bf16: 3 waves of 4
    assert default_num_splits(8, 8, 2048, gpu, fp8=True) == 16  # capped
    assert default_num_splits(8, 8, 40, gpu, fp8=True) == 2  # one split per 32-key tile
    assert default_num_splits(1, 8, 2048, gpu, fp8=True) == 16  # as proportional splits


BALANCE_CASES = [
    # (q_lens, seq_lens): decode rows of very different lengths; one long among short ones;
    # rows of several tokens (speculative verification); a padding-like row of one key
    ([1, 1, 1, 1], [3, 200, 17, 90]),
    ([1] * 6, [9, 8, 7, 6, 5, 300]),
    ([3, 1, 4], [40, 150, 12]),
    ([1, 1], [1, 130]),
]


@pytest.mark.parametrize("q_lens,seq_lens", BALANCE_CASES)
@pytest.mark.parametrize("num_splits,split_programs", [(2, 1), (3, 4), (8, 7), (5, 1000)])
def test_balanced_splits_match_reference(
    device: torch.device,
    q_lens: list[int],
    seq_lens: list[int],
    num_splits: int,
    split_programs: int,
) -> None:
    """Balanced splits (every split the same run of key tiles, at least enough runs to cover
    the longest request, many splits without keys) give the attention of the reference: a few
    programs (long runs, the covering bound), many (the two-tile floor)."""
    torch.manual_seed(sum(seq_lens) + num_splits + split_programs)
    q, cache, tables, lens, qsl = _batch(device, q_lens, seq_lens, (4, 2), 16, 4, torch.float32)
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, cache, tables, lens, qsl, max(q_lens), 0.25, num_splits, out=out,
        split_programs=split_programs,
    )  # fmt: skip
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.25)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_balanced_splits_over_an_fp8_cache(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(31)
    q_lens, seq_lens = [1, 1, 1, 1, 1], [5, 260, 33, 1, 120]
    q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
        device, q_lens, seq_lens, (4, 2), 16, 4, dtype
    )
    out = paged_attention(
        q, cache, tables, lens, qsl, 1, 0.25, 6, kv_scale=kv_scale, split_programs=10
    )
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.25, kv_scale)
    assert _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_split_programs_must_be_positive(device: torch.device) -> None:
    q, cache, tables, lens, qsl = _batch(device, [1], [9], (2, 1), 16, 4, torch.float32)
    with pytest.raises(ValueError, match="split_programs"):
        paged_attention(q, cache, tables, lens, qsl, 1, 0.25, 2, split_programs=0)


def test_many_splits_most_of_them_empty(device: torch.device) -> None:
    """A decode graph captured for a long horizon: 64 splits over contexts of 1 to 300 keys,
    so most splits own no key tile and only the merge sees them."""
    torch.manual_seed(6)
    q, cache, tables, lens, qsl = _batch(
        device, [1, 1, 1], [1, 70, 300], (4, 2), 16, 4, torch.float32
    )
    out = paged_attention(q, cache, tables, lens, qsl, 1, 0.25, num_splits=64)
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.25)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 8, 64])
def test_paged_attention_bf16_real_shapes(device: torch.device, num_splits: int) -> None:
    torch.manual_seed(5)
    q_lens = [1] * 6 + [300, 1000]
    seq_lens = [100, 1500, 3000, 17, 1, 800, 700, 1000]
    q, cache, tables, lens, qsl = _batch(device, q_lens, seq_lens, (32, 8), 128, 16, torch.bfloat16)
    out = paged_attention(q, cache, tables, lens, qsl, max(q_lens), 128**-0.5, num_splits)
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 128**-0.5)
    assert _rel_err(out, ref) < 1e-2


def _fp8_batch(
    device: torch.device,
    q_lens: list[int],
    seq_lens: list[int],
    heads: tuple[int, int],
    dim: int,
    page: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """`_batch` with an FP8 cache (random e4m3 bytes, NaN patterns excluded) and per-head
    scales."""
    q, cache, tables, lens, qsl = _batch(device, q_lens, seq_lens, heads, dim, page, dtype)
    cache = (cache.float() * 40).to(torch.float8_e4m3fn)
    kv_scale = (torch.rand(2, heads[1], device=device) * 0.05 + 0.01).contiguous()
    return q, cache, tables, lens, qsl, kv_scale


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("dim", [16, 12])  # rotated keys (power of two) and unrotated
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_fp8_matches_reference(
    device: torch.device, q_lens: list[int], seq_lens: list[int], dim: int, num_splits: int
) -> None:
    torch.manual_seed(sum(seq_lens) + dim + num_splits)
    q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
        device, q_lens, seq_lens, (4, 2), dim, 4, torch.float32
    )
    out = torch.full_like(q, float("nan"))
    paged_attention(q, cache, tables, lens, qsl, max(q_lens), 0.25, num_splits, out, kv_scale)
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.25, kv_scale)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < 1e-5


def test_fp8_cache_round_trip_close_to_unquantized(device: torch.device) -> None:
    """Keys and values written through `write_kv` into FP8 and read by the kernel give nearly
    the attention of the unquantized cache; keys with an outlier channel included."""
    from davit_engine.kernels.kv_cache import write_kv

    torch.manual_seed(8)
    heads, dim, page = (4, 2), 32, 4
    q, cache, tables, lens, qsl = _batch(device, [1, 6], [21, 14], heads, dim, page, torch.float32)
    keys = torch.randn(35, heads[1], dim, device=device)
    keys[..., 3] *= 20  # outlier channel
    values = torch.randn(35, heads[1], dim, device=device)
    slots = torch.cat(
        [
            tables[r].long().repeat_interleave(page)[:n] * page + torch.arange(n, device=device) % page
            for r, n in enumerate([21, 14])
        ]
    )  # fmt: skip
    exact_cache = torch.zeros_like(cache)
    write_kv(keys, values, exact_cache, slots)
    fp8_cache = torch.zeros_like(cache, dtype=torch.float8_e4m3fn)
    rotated_max = (keys @ hadamard(dim, device)).abs().amax(dim=(0, 2))
    kv_scale = torch.stack([rotated_max, values.abs().amax(dim=(0, 2))]) / 448
    write_kv(keys, values, fp8_cache, slots, kv_scale.contiguous())
    exact = paged_attention(q, exact_cache, tables, lens, qsl, 6, dim**-0.5)
    ours = paged_attention(q, fp8_cache, tables, lens, qsl, 6, dim**-0.5, kv_scale=kv_scale)
    assert _rel_err(ours, exact) < 0.1  # e4m3 keeps 3 mantissa bits; sharp scores here


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_fp8_fp16_queries(device: torch.device, num_splits: int) -> None:
    """Half-precision queries take the fp16 products over keys widened by moving bits."""
    torch.manual_seed(11 + num_splits)
    q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
        device, [1, 7, 1], [33, 7, 50], (4, 2), 16, 4, torch.float16
    )
    out = paged_attention(q, cache, tables, lens, qsl, 7, 0.25, num_splits, kv_scale=kv_scale)
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.25, kv_scale)
    assert _rel_err(out, ref) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 8])
def test_paged_attention_fp8_bf16_real_shapes(device: torch.device, num_splits: int) -> None:
    torch.manual_seed(9)
    q_lens = [1] * 6 + [300, 1000]
    seq_lens = [100, 1500, 3000, 17, 1, 800, 700, 1000]
    q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
        device, q_lens, seq_lens, (32, 8), 128, 16, torch.bfloat16
    )
    out = paged_attention(
        q, cache, tables, lens, qsl, max(q_lens), 128**-0.5, num_splits, kv_scale=kv_scale
    )
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 128**-0.5, kv_scale)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_fp8_takes_rotated_queries(
    device: torch.device, dtype: torch.dtype, num_splits: int
) -> None:
    """`queries_rotated`: given `q @ H` the kernel skips its own rotation and gives the
    attention of `q` (the rotary kernel rotates queries so in the V2 runner)."""
    torch.manual_seed(21 + num_splits)
    q_lens, seq_lens = [1, 7, 1, 12], [33, 7, 2, 50]
    q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
        device, q_lens, seq_lens, (4, 2), 16, 4, dtype
    )
    q_rot = (q.float() @ hadamard(16, device)).to(dtype)
    out = paged_attention(
        q_rot, cache, tables, lens, qsl, 12, 0.25, num_splits, kv_scale=kv_scale,
        queries_rotated=True,
    )  # fmt: skip
    in_kernel = paged_attention(
        q, cache, tables, lens, qsl, 12, 0.25, num_splits, kv_scale=kv_scale
    )
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.25, kv_scale)
    assert _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)
    assert _rel_err(out, in_kernel) < (1e-6 if dtype == torch.float32 else 1e-3)


def test_rotated_queries_are_refused_where_keys_are_not_rotated(device: torch.device) -> None:
    torch.manual_seed(2)
    q, cache, tables, lens, qsl = _batch(device, [1], [9], (4, 2), 16, 4, torch.float32)
    with pytest.raises(ValueError, match="queries_rotated"):
        paged_attention(q, cache, tables, lens, qsl, 1, 0.25, queries_rotated=True)
    q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
        device, [1], [9], (4, 2), 12, 4, torch.float32
    )
    with pytest.raises(ValueError, match="head dim 12"):
        paged_attention(
            q, cache, tables, lens, qsl, 1, 0.25, kv_scale=kv_scale, queries_rotated=True
        )


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 16])
def test_paged_attention_fp8_decode_rotated_queries_real_shapes(
    device: torch.device, num_splits: int
) -> None:
    """The V2 runner's FP8 decode launch (rotated queries; unsplit: the register-capped tiles)
    at real head shapes and contexts up to 2,000 keys."""
    torch.manual_seed(30 + num_splits)
    seq_lens = torch.randint(1, 2000, (64,)).tolist()
    q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
        device, [1] * 64, seq_lens, (16, 8), 128, 16, torch.bfloat16
    )
    q_rot = (q.float() @ hadamard(128, device)).to(torch.bfloat16)
    out = paged_attention(
        q_rot, cache, tables, lens, qsl, 1, 128**-0.5, num_splits, kv_scale=kv_scale,
        queries_rotated=True,
    )  # fmt: skip
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 128**-0.5, kv_scale)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_splits", [3, 16])
def test_balanced_splits_real_shapes(device: torch.device, fp8: bool, num_splits: int) -> None:
    """Balanced split decodes as the engine launches them (`BALANCE_SPLITS`: the GPU's
    balanced target) at real head shapes, contexts from 1 to 2,000 keys."""
    from davit_engine.kernels import paged_attention as pa

    torch.manual_seed(40 + num_splits)
    seq_lens = torch.randint(1, 2000, (96,)).tolist()
    programs = pa.balanced_split_programs(device, fp8)
    if fp8:
        q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
            device, [1] * 96, seq_lens, (16, 8), 128, 16, torch.bfloat16
        )
        q_in = (q.float() @ hadamard(128, device)).to(torch.bfloat16)
    else:
        q, cache, tables, lens, qsl = _batch(
            device, [1] * 96, seq_lens, (16, 8), 128, 16, torch.bfloat16
        )
        kv_scale, q_in = None, q
    out = paged_attention(
        q_in, cache, tables, lens, qsl, 1, 128**-0.5, num_splits, kv_scale=kv_scale,
        queries_rotated=fp8, split_programs=programs,
    )  # fmt: skip
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 128**-0.5, kv_scale)
    assert _rel_err(out, ref) < 1e-2


def _float32_batch(
    device: torch.device, q_lens: list[int], seq_lens: list[int], fp8: bool
) -> tuple[Any, ...]:
    """A float32 batch of 4 / 2 heads of 16 in pages of 4 over a model-dtype or FP8 cache:
    (q, cache, block tables, lengths, query starts, the FP8 cache's scales or None)."""
    if fp8:
        return _fp8_batch(device, q_lens, seq_lens, (4, 2), 16, 4, torch.float32)
    return (*_batch(device, q_lens, seq_lens, (4, 2), 16, 4, torch.float32), None)


def _early_loads_agree(
    monkeypatch: pytest.MonkeyPatch, run: Callable[[], torch.Tensor], exact: bool = True
) -> None:
    """`run()` with the attention kernel's loads before the wait (`LOADS_BEFORE_WAIT`, the
    default) gives what it gives with them after it."""
    from davit_engine.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "LOADS_BEFORE_WAIT", False)
    before = run()
    monkeypatch.setattr(pa, "LOADS_BEFORE_WAIT", True)
    after = run()
    assert not before.isnan().any()
    if exact:
        assert torch.equal(before, after)
    else:
        torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("q_lens,seq_lens", [*CASES, ([1, 1, 9], [300, 129, 200])])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_loads_before_the_wait_change_nothing(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    q_lens: list[int],
    seq_lens: list[int],
    fp8: bool,
    num_splits: int,
) -> None:
    """Decode, prefill and mixed batches, unsplit, split (64: most splits own no key tile),
    model-dtype and FP8 caches: the same result bit for bit. Each tile's block-table entries
    are then loaded a tile ahead, so a program's range must hold several key tiles (300 keys
    in pages of 4: five decode tiles unsplit, two a split in three)."""
    torch.manual_seed(sum(seq_lens) + num_splits + fp8)
    q, cache, tables, lens, qsl, kv_scale = _float32_batch(device, q_lens, seq_lens, fp8)
    _early_loads_agree(monkeypatch, lambda: paged_attention(
        q, cache, tables, lens, qsl, max(q_lens), 0.25, num_splits, kv_scale=kv_scale
    ))  # fmt: skip


@pytest.mark.parametrize("fp8", [False, True])
def test_loads_before_the_wait_with_balanced_splits(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, fp8: bool
) -> None:
    torch.manual_seed(32)
    q_lens, seq_lens = [1, 1, 1, 1, 1], [5, 260, 33, 1, 120]
    q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
        device, q_lens, seq_lens, (4, 2), 16, 4, torch.float32
    )
    if not fp8:
        cache, kv_scale = cache.float(), None
    _early_loads_agree(monkeypatch, lambda: paged_attention(
        q, cache, tables, lens, qsl, 1, 0.25, 6, kv_scale=kv_scale, split_programs=10
    ))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("requests", "num_splits"), [(1, 16), (64, 2), (64, 1)])
def test_loads_before_the_wait_real_shapes_in_a_graph(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, fp8: bool, requests: int,
    num_splits: int,
) -> None:  # fmt: skip
    """A decode step's rotary kernel (the new token's keys and values into the cache, the
    queries rotated for an FP8 cache) then attention, as the V2 runner launches them: W2's one
    request of 1,152 keys in 16 splits, and 64 requests of up to 2,000 keys; bf16 or FP8.
    Captured in a graph with both kernels' loads before the wait (programmatic dependent
    launch: attention's early loads overlap the rotary kernel that writes its queries and
    keys), three steps in a row: each the eager launch's result without early loads, bit for
    bit."""
    from davit_engine.kernels import layer_ops
    from davit_engine.kernels import paged_attention as pa

    torch.manual_seed(50 + requests + num_splits)
    seq_lens = [1152] if requests == 1 else torch.randint(2, 2000, (requests,)).tolist()
    heads, kv_heads, dim, page = 32, 8, 128, 16
    if fp8:
        _, cache, tables, lens, qsl, kv_scale = _fp8_batch(
            device, [1] * requests, seq_lens, (heads, kv_heads), dim, page, torch.bfloat16
        )
    else:
        _, cache, tables, lens, qsl = _batch(
            device, [1] * requests, seq_lens, (heads, kv_heads), dim, page, torch.bfloat16
        )
        kv_scale = None
    last = lens.long() - 1  # the new token's position
    slots = tables.long().gather(1, (last // page)[:, None])[:, 0] * page + last % page
    angles = torch.rand(requests, dim // 2, device=device) * 6.0
    cos = torch.cat((angles, angles), -1).cos().to(torch.bfloat16)
    sin = torch.cat((angles, angles), -1).sin().to(torch.bfloat16)
    steps = [torch.randn(requests, heads + 2 * kv_heads, dim, device=device).to(torch.bfloat16)
             for _ in range(3)]  # fmt: skip
    qkv = torch.empty_like(steps[0])
    start = cache.clone()

    def step() -> torch.Tensor:
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        q_rot, _ = layer_ops.qk_norm_rope(
            q, k, cos, sin, v=v, kv_cache=cache, slot_mapping=slots, kv_scale=kv_scale,
            rotate_queries=fp8,
        )  # fmt: skip
        return paged_attention(
            q_rot, cache, tables, lens, qsl, 1, dim**-0.5, num_splits, kv_scale=kv_scale,
            queries_rotated=fp8,
        )  # fmt: skip

    monkeypatch.setattr(pa, "LOADS_BEFORE_WAIT", False)
    monkeypatch.setattr(layer_ops, "ROTARY_LOADS_BEFORE_WAIT", False)
    expected = []
    for values in steps:  # eager, no early loads
        qkv.copy_(values)
        expected.append(step().clone())
    monkeypatch.setattr(pa, "LOADS_BEFORE_WAIT", True)
    monkeypatch.setattr(layer_ops, "ROTARY_LOADS_BEFORE_WAIT", True)
    cache.copy_(start)
    qkv.copy_(steps[0])
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    cache.copy_(start)
    for values, want in zip(steps, expected, strict=True):
        qkv.copy_(values)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("warps", [4, 8])
def test_short_splits_at_either_warp_count(
    device: torch.device, fp8: bool, warps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode split in many short ranges (more than `_PIPELINED_MAX_SPLITS`) at 4 or 8 warps
    a program (`SHORT_SPLIT_NUM_WARPS`): the reference's attention either way."""
    from davit_engine.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "SHORT_SPLIT_NUM_WARPS", warps)
    torch.manual_seed(11 + fp8)
    q, cache, tables, lens, qsl, kv_scale = _float32_batch(device, [1, 1], [300, 41], fp8)
    out = paged_attention(q, cache, tables, lens, qsl, 1, 0.25, 12, kv_scale=kv_scale)
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.25, kv_scale)
    assert _rel_err(out, ref) < 1e-5
