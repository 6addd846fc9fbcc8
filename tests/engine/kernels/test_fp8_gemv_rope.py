"""The one-row q/k/v product that finishes its heads (`fp8_gemv.fp8_gemv_rope`) against the
two kernels it replaces: the product (`fp8_gemv`), then the rotary kernel writing the cache
(`layer_ops.qk_norm_rope`)."""

from __future__ import annotations

import pytest
import torch

from davit_engine.kernels import fp8_gemv
from davit_engine.kernels.fp8 import hadamard_factors
from davit_engine.kernels.layer_ops import qk_norm_rope
from davit_engine.layers.fp8 import FP8_DTYPE, hadamard
from tests.engine.kernels.fp8_cases import fp8_weights


def _case(
    device: torch.device,
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    dim: int,
    k: int,
    *,
    fp8_cache: bool,
    rotate_queries: bool = False,
    qk_norm: bool = False,
    bias: bool = False,
    normed: bool = False,
    slot: int = 5,
    page: int = 4,
    num_blocks: int = 3,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Both ways on one random layer; returns the queries and caches of each."""
    torch.manual_seed(seed)
    n = (hq + 2 * hkv) * dim
    weight, scale = fp8_weights(n, k, device)
    x = torch.randn(1, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    angles = torch.rand(dim // 2, device=device) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()]).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()]).to(dtype)
    q_w = (torch.rand(dim, device=device) + 0.5).to(dtype) if qk_norm else None
    k_w = (torch.rand(dim, device=device) + 0.5).to(dtype) if qk_norm else None
    cache_dtype = FP8_DTYPE if fp8_cache else dtype
    shape = (2, num_blocks, page, hkv, dim)
    kv_scale = (torch.rand(2, hkv, device=device) * 0.05 + 0.01) if fp8_cache else None
    slots = torch.tensor([slot], dtype=torch.int64, device=device)
    squares = None
    if normed:  # x is s * norm weight; the norm's 1/rms comes from the sums of squares
        s = torch.randn(1, k, device=device).to(dtype)
        squares = s.float().pow(2).reshape(4, -1).sum(1).contiguous()

    # the two kernels
    if normed:
        assert squares is not None
        qkv = fp8_gemv.fp8_gemv_normed(x, squares, 1e-5, weight, scale, b)
    else:
        qkv = fp8_gemv.fp8_gemv(x, weight, scale, b)
    q, kk, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    ref_cache = torch.zeros(shape, device=device).to(cache_dtype)
    ref_q, _ = qk_norm_rope(
        q.view(1, hq, dim), kk.view(1, hkv, dim), cos[None], sin[None], q_w, k_w, 1e-6,
        v=v.view(1, hkv, dim), kv_cache=ref_cache, slot_mapping=slots, kv_scale=kv_scale,
        rotate_queries=rotate_queries,
    )  # fmt: skip

    # one launch
    cache = torch.zeros(shape, device=device).to(cache_dtype)
    counts = fp8_gemv.head_counts(device, hq + 2 * hkv)
    assert counts is not None
    out_q = fp8_gemv.fp8_gemv_rope(
        x, weight, scale, b, hq, hkv, cos, sin, cache, slots, counts, kv_scale,
        (q_w, k_w, 1e-6) if qk_norm else None, rotate_queries,  # type: ignore[arg-type]
        (squares, 1e-5) if squares is not None else None,
    )  # fmt: skip
    assert int(counts.abs().sum()) == 0, "every head's count is back to zero"
    return {"q": out_q, "ref_q": ref_q, "cache": cache, "ref_cache": ref_cache}


def _assert_same(r: dict[str, torch.Tensor], exact: bool) -> None:
    assert r["q"].shape == r["ref_q"].shape and r["q"].dtype == r["ref_q"].dtype
    if exact:
        assert torch.equal(r["q"], r["ref_q"])
        assert torch.equal(r["cache"].view(torch.uint8), r["ref_cache"].view(torch.uint8))
        return
    # An FP8 cache's rotation by H sums in another order than the matrix-unit product: the
    # rotated queries within float32 rounding, the cache bytes at most one e4m3 step apart
    torch.testing.assert_close(r["q"].float(), r["ref_q"].float(), rtol=1e-5, atol=1e-5)
    codes, ref_codes = r["cache"].view(torch.int8).int(), r["ref_cache"].view(torch.int8).int()
    differ = codes != ref_codes
    assert int(differ.sum()) <= max(2, codes.numel() // 500)
    assert bool(((codes - ref_codes)[differ].abs() <= 1).all())


@pytest.mark.parametrize("dim", [16, 32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_model_dtype_cache_is_the_two_kernels_bit_for_bit(
    device: torch.device, dim: int, bias: bool, qk_norm: bool
) -> None:
    """A cache in the model dtype: the rotary arithmetic is the rotary kernel's own
    (`norm_rope_halves`), so queries and cache are the two kernels' bit for bit; q/k/v with a
    bias (Qwen2) and per-head norms (Qwen3) included."""
    r = _case(device, torch.float32, 4, 2, dim, 96, fp8_cache=False, bias=bias, qk_norm=qk_norm,
              seed=dim + bias * 2 + qk_norm)  # fmt: skip
    _assert_same(r, exact=True)
    assert bool(r["cache"].abs().sum() > 0)


@pytest.mark.parametrize("rotate_queries", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fp8_cache(device: torch.device, rotate_queries: bool, qk_norm: bool) -> None:
    """An FP8 cache: keys rotated by H, divided by the head's scale and rounded to e4m3, values
    key-minor, the queries times H where asked."""
    r = _case(device, torch.float32, 4, 2, 32, 96, fp8_cache=True,
              rotate_queries=rotate_queries, qk_norm=qk_norm, seed=7 + rotate_queries)  # fmt: skip
    _assert_same(r, exact=False)
    assert int((r["cache"].view(torch.uint8) != 0).sum()) > 0


def test_norm_folded_in_and_a_second_launch(device: torch.device) -> None:
    """With the norm's 1/rms on the sums (`normed`, the norm chain's q/k/v), twice in a row:
    the counts left at zero by the first launch serve the second."""
    for seed in (1, 2):
        _assert_same(_case(device, torch.float32, 2, 1, 16, 64, fp8_cache=False, normed=True,
                           seed=seed), exact=True)  # fmt: skip


def test_padding_slot_writes_nothing(device: torch.device) -> None:
    """A negative slot (a CUDA graph's padding token): the queries are returned, the cache is
    untouched."""
    r = _case(device, torch.float32, 2, 1, 16, 64, fp8_cache=True, rotate_queries=True, slot=-1)
    assert int(r["cache"].view(torch.uint8).sum()) == 0
    _assert_same(r, exact=False)


def test_refusals(device: torch.device) -> None:
    weight, scale = fp8_weights(64, 32, device)
    x = torch.randn(1, 32, device=device)
    cache = torch.zeros(2, 1, 4, 1, 16, device=device)
    cs = torch.ones(16, device=device)
    counts = fp8_gemv.head_counts(device, 8)
    assert counts is not None
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="not \\(Hq \\+ 2 Hkv\\) \\* D"):
        fp8_gemv.fp8_gemv_rope(x, weight, scale, None, 3, 1, cs, cs, cache, slots, counts)
    with pytest.raises(ValueError, match="one row only"):
        fp8_gemv.fp8_gemv_rope(torch.cat([x, x]), weight, scale, None, 2, 1, cs, cs, cache,
                               slots, counts)  # fmt: skip
    with pytest.raises(ValueError, match="a cache of torch.bfloat16"):
        fp8_gemv.fp8_gemv_rope(x, weight, scale, None, 2, 1, cs, cs, cache.bfloat16(), slots,
                               counts)  # fmt: skip
    with pytest.raises(ValueError, match="rotate_queries"):
        fp8_gemv.fp8_gemv_rope(x, weight, scale, None, 2, 1, cs, cs, cache, slots, counts,
                               rotate_queries=True)  # fmt: skip
    assert fp8_gemv.rope_config(2, 1, 12, device) is None  # half of 6: not a power of two


@pytest.mark.parametrize("half", [4, 8, 16, 32, 64, 128])
def test_hadamard_factors_make_the_sylvester_matrix(half: int) -> None:
    """H of 2 * half is H_2 (x) H_A (x) H_B: the factors `hadamard_halves` multiplies by."""
    a, b = hadamard_factors(half)
    assert a * b == half and a >= 2
    small = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)

    def sylvester(size: int) -> torch.Tensor:
        m = torch.ones(1, 1, dtype=torch.float64)
        while m.shape[0] < size:
            m = torch.kron(small, m)
        return m

    built = torch.kron(small, torch.kron(sylvester(a), sylvester(b)))
    if 2 * half >= 16:
        assert torch.equal(built, hadamard(2 * half, torch.device("cpu"), torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_cache", [True, False])
def test_llama_8b_shapes_in_a_graph(fp8_cache: bool) -> None:
    """Llama-3.1-8B's q/k/v (32 / 8 heads of 128, K 4,096) in bf16 on the GPU, the queries
    rotated for an FP8 cache: eager, then captured in a CUDA graph and replayed three times
    with new inputs, each against the two kernels."""
    device = torch.device("cuda")
    hq, hkv, dim, k = 32, 8, 128, 4096
    n = (hq + 2 * hkv) * dim
    torch.manual_seed(3)
    weight, scale = fp8_weights(n, k, device)
    shape = (2, 8, 16, hkv, dim)
    cache_dtype = FP8_DTYPE if fp8_cache else torch.bfloat16
    kv_scale = torch.rand(2, hkv, device=device) * 0.05 + 0.01 if fp8_cache else None
    x = torch.empty(1, k, device=device, dtype=torch.bfloat16)
    cos = torch.empty(dim, device=device, dtype=torch.bfloat16)
    sin = torch.empty_like(cos)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    cache = torch.zeros(shape, device=device).to(cache_dtype)
    counts = fp8_gemv.head_counts(device, hq + 2 * hkv)
    assert counts is not None

    def fill(seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        x.copy_(torch.randn(1, k, generator=g).to(torch.bfloat16))
        angles = torch.rand(dim // 2, generator=g) * 6.0
        cos.copy_(torch.cat([angles.cos(), angles.cos()]).to(torch.bfloat16))
        sin.copy_(torch.cat([angles.sin(), angles.sin()]).to(torch.bfloat16))
        slots.fill_(seed * 7 % 128)

    def fused() -> torch.Tensor:
        return fp8_gemv.fp8_gemv_rope(x, weight, scale, None, hq, hkv, cos, sin, cache, slots,
                                      counts, kv_scale, None, fp8_cache)  # fmt: skip

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        ref_cache = cache.clone()
        q, kk, v = fp8_gemv.fp8_gemv(x, weight, scale).split([hq * dim, hkv * dim, hkv * dim], -1)
        ref_q, _ = qk_norm_rope(
            q.view(1, hq, dim), kk.view(1, hkv, dim), cos[None], sin[None],
            v=v.view(1, hkv, dim), kv_cache=ref_cache, slot_mapping=slots, kv_scale=kv_scale,
            rotate_queries=fp8_cache,
        )  # fmt: skip
        return ref_q, ref_cache

    fill(1)
    before = cache.clone()
    ref_q, ref_cache = reference()
    cache.copy_(before)
    out = fused()
    torch.cuda.synchronize()
    _assert_same({"q": out, "ref_q": ref_q, "cache": cache, "ref_cache": ref_cache},
                 exact=not fp8_cache)  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused()
    for seed in (2, 3, 4):
        fill(seed)
        before = cache.clone()
        ref_q, ref_cache = reference()
        cache.copy_(before)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same({"q": captured, "ref_q": ref_q, "cache": cache, "ref_cache": ref_cache},
                     exact=not fp8_cache)  # fmt: skip
    assert int(counts.abs().sum()) == 0
