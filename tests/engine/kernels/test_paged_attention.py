from __future__ import annotations

import pytest
import torch

from davit_engine.kernels import paged_attention as pa
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


def test_default_num_splits() -> None:
    gpu = torch.device("cuda")
    assert default_num_splits(1, 8, 1280, gpu) == 16  # capped
    assert default_num_splits(1, 8, 300, gpu) == 10  # one split per 32-key tile
    assert default_num_splits(1, 8, 5, gpu) == 1
    # The interpreter runs programs one after another: splits would only add the merge.
    assert default_num_splits(1, 8, 1280, torch.device("cpu")) == 1
    assert default_num_splits(16, 8, 100_000, gpu) == 5  # 128 programs -> ~4 per multiprocessor
    assert default_num_splits(256, 8, 4096, gpu) == 1


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


def _counters_zero(device: torch.device) -> bool:
    counters = pa._COUNTERS.get((device.type, device.index))
    return counters is not None and not bool(counters.any())


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("num_splits", [2, 3, 64])
def test_merge_in_kernel_gives_the_merge_kernels_result(
    device: torch.device, q_lens: list[int], seq_lens: list[int], num_splits: int
) -> None:
    """The last split program merges (`merge_in_kernel=True`): the merge kernel's result up to
    the order of the float32 sum over splits, decode and prefill tiles, splits that own no
    keys; the counters are back at zero afterwards, so a second launch (a graph replay) merges
    again."""
    torch.manual_seed(sum(seq_lens) + num_splits)
    q, cache, tables, lens, qsl = _batch(device, q_lens, seq_lens, (4, 2), 16, 4, torch.float32)
    args = (q, cache, tables, lens, qsl, max(q_lens), 0.25, num_splits)
    separate = paged_attention(*args, merge_in_kernel=False)
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        paged_attention(*args, out=out, merge_in_kernel=True)
        assert not out.isnan().any()
        assert _rel_err(out, separate) < 1e-6
        assert _counters_zero(device)
    assert _rel_err(out, paged_attention_reference(q, cache, tables, lens, qsl, 0.25)) < 1e-5


def test_merge_in_kernel_fp8_rotated_queries_and_padding(device: torch.device) -> None:
    """An FP8 cache with pre-rotated queries and a padding row without blocks (a CUDA graph's):
    the in-kernel merge equals the merge kernel's result, the padding row stays zero."""
    torch.manual_seed(21)
    q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
        device, [1, 1, 1], [37, 1, 90], (4, 2), 16, 4, torch.float32
    )
    tables[1] = -1
    h = hadamard(16, device)
    q_rot = (q.float() @ h).to(q.dtype)
    args = (q_rot, cache, tables, lens, qsl, 1, 0.25, 4)
    separate = paged_attention(*args, kv_scale=kv_scale, queries_rotated=True,
                               merge_in_kernel=False)  # fmt: skip
    fused = paged_attention(*args, kv_scale=kv_scale, queries_rotated=True, merge_in_kernel=True)
    assert torch.equal(fused[1], torch.zeros_like(fused[1]))
    assert _rel_err(fused, separate) < 1e-6
    assert _counters_zero(device)


def test_merge_in_kernel_follows_the_module_switch(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`merge_in_kernel` unset follows MERGE_SPLITS_IN_KERNEL; the counters grow for a batch
    larger than they hold and the old ones are kept (a captured graph may point at them)."""
    torch.manual_seed(22)
    monkeypatch.setattr(pa, "_COUNTERS", {})
    monkeypatch.setattr(pa, "_RETIRED_COUNTERS", [])
    monkeypatch.setattr(pa, "_MIN_COUNTERS", 4)
    q, cache, tables, lens, qsl = _batch(device, [1] * 3, [9, 30, 5], (4, 2), 16, 4, torch.float32)
    paged_attention(q, cache, tables, lens, qsl, 1, 0.25, 2)
    assert not pa._COUNTERS  # off by default: the merge kernel ran
    monkeypatch.setattr(pa, "MERGE_SPLITS_IN_KERNEL", True)
    small = paged_attention(q[:1], cache, tables[:1], lens[:1], qsl[:2], 1, 0.25, 2)
    assert pa._COUNTERS[(device.type, device.index)].numel() == 4
    out = paged_attention(q, cache, tables, lens, qsl, 1, 0.25, 2)
    assert pa._COUNTERS[(device.type, device.index)].numel() == 6  # 3 requests x 2 KV heads
    assert len(pa._RETIRED_COUNTERS) == 1
    ref = paged_attention_reference(q, cache, tables, lens, qsl, 0.25)
    assert _rel_err(out, ref) < 1e-5 and _rel_err(small, ref[:1]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(
    ("batch", "ctx", "num_splits"), [(1, 1152, 16), (64, 1500, 2), (4, 900, 9)]
)
def test_merge_in_kernel_real_shapes(
    device: torch.device, fp8: bool, batch: int, ctx: int, num_splits: int
) -> None:
    """Decode at W2's and W1's split shapes, bf16 and FP8 (rotated queries), 20 launches in a
    row: every one equals the merge kernel's result (a lost or early merge would show as
    stale rows, the counters as nonzero)."""
    torch.manual_seed(23)
    seq_lens = [ctx - 7 * i for i in range(batch)]
    if fp8:
        q, cache, tables, lens, qsl, kv_scale = _fp8_batch(
            device, [1] * batch, seq_lens, (32, 8), 128, 16, torch.bfloat16
        )
        q = (q.float() @ hadamard(128, device)).to(q.dtype)
    else:
        q, cache, tables, lens, qsl = _batch(
            device, [1] * batch, seq_lens, (32, 8), 128, 16, torch.bfloat16
        )
        kv_scale = None
    kwargs = {"kv_scale": kv_scale, "queries_rotated": fp8}
    args = (q, cache, tables, lens, qsl, 1, 128**-0.5, num_splits)
    separate = paged_attention(*args, merge_in_kernel=False, **kwargs)
    for _ in range(20):
        out = torch.full_like(q, float("nan"))
        paged_attention(*args, out=out, merge_in_kernel=True, **kwargs)
        torch.testing.assert_close(out, separate, rtol=1e-2, atol=1e-3)
    assert _counters_zero(device)


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [False, True])
def test_merge_in_kernel_inside_a_cuda_graph(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, warm: bool
) -> None:
    """Counters made before the capture (the runner's eager warm-up): the graph merges in the
    kernel, replay after replay. None yet: the capture does not make them (their zeros would
    come only with a replay) and merges with the kernel instead."""
    torch.manual_seed(24)
    monkeypatch.setattr(pa, "_COUNTERS", {})
    q, cache, tables, lens, qsl = _batch(
        device, [1] * 4, [1000, 37, 512, 800], (32, 8), 128, 16, torch.bfloat16
    )
    args = (q, cache, tables, lens, qsl, 1, 128**-0.5, 8)
    expected = paged_attention(*args, merge_in_kernel=False)
    out = torch.empty_like(q)
    if warm:
        paged_attention(*args, out=out, merge_in_kernel=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args, out=out, merge_in_kernel=True)
    assert bool(pa._COUNTERS) == warm
    for _ in range(5):
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-3)
    if warm:
        assert _counters_zero(device)
