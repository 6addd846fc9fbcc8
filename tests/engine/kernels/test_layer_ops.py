from __future__ import annotations

from typing import Any

import pytest
import torch

from davit_engine.kernels import layer_ops
from davit_engine.kernels.kv_cache import write_kv, write_kv_reference
from davit_engine.kernels.layer_ops import (
    _rms_norm_rows,
    add_rms_norm,
    add_rms_norm_reference,
    qk_norm_rope,
    qk_norm_rope_reference,
    rms_norm,
    rms_norm_reference,
    silu_mul,
    silu_mul_reference,
)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    # float32 summation order may differ from torch's; nothing else may
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    return bool(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol))


def test_rms_norm_tiles_stay_small_on_the_gpu() -> None:
    """A program's tile of a model's hidden size stays one row on a GPU: 16 rows of 2,048
    spilled registers (49-245 us per call on an H200 against 1.5-17.5 us). The interpreter
    keeps 16 rows per program."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    for block_d in (512, 1024, 2048, 4096, 8192, 16384):
        assert _rms_norm_rows(block_d, gpu) == 1
        assert _rms_norm_rows(block_d, cpu) == 16
    assert _rms_norm_rows(128, gpu) * 128 <= 4096  # q/k norms over head-wide rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_2d_and_strided_3d(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = (1 + 0.1 * torch.randn(32, device=device)).to(dtype)
    x = torch.randn(5, 32, device=device).to(dtype)
    assert _close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), dtype)
    # q heads as a strided view of a fused projection: [T, H, D] with row stride != H * D
    fused = torch.randn(7, 3 * 32 + 16, device=device).to(dtype)
    q = fused[:, : 3 * 32].view(7, 3, 32)
    assert _close(rms_norm(q, weight, 1e-6), rms_norm_reference(q, weight, 1e-6), dtype)


def _rope_case(
    device: torch.device,
    dtype: torch.dtype,
    dim: int,
    positions: list[int],
    heads: int,
    kv_heads: int,
    spread: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """cos and sin at `positions` as the model looks them up once per step ([T, 1, D] in the
    activation dtype), and q, k, v as strided views of one fused qkv projection."""
    at = torch.tensor(positions, device=device)
    angles = torch.outer(torch.arange(12.0, device=device), torch.rand(dim // 2, device=device))
    emb = torch.cat((angles, angles), dim=-1)
    cos = emb.cos()[at].unsqueeze(1).to(dtype)
    sin = emb.sin()[at].unsqueeze(1).to(dtype)
    qkv = spread * torch.randn(len(positions), heads + 2 * kv_heads, dim, device=device)
    qkv = qkv.to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    return cos, sin, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope(device: torch.device, dtype: torch.dtype, with_norm: bool) -> None:
    torch.manual_seed(1)
    dim = 16
    cos, sin, q, k, _ = _rope_case(device, dtype, dim, [0, 5, 9, 2], 3, 1)
    weights = (1 + 0.1 * torch.randn(2, dim, device=device)).to(dtype) if with_norm else None
    qw = weights[0] if weights is not None else None
    kw = weights[1] if weights is not None else None
    ours = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)
    ref = qk_norm_rope_reference(q, k, cos, sin, qw, kw, 1e-6)
    for a, b in zip(ours, ref, strict=True):
        assert _close(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_writes_the_kv_cache(
    device: torch.device, dtype: torch.dtype, with_norm: bool
) -> None:
    """With a cache the rotated keys and the values land at each token's slot exactly as
    rotary followed by `write_kv` would put them; padding slots (-1) write nothing."""
    torch.manual_seed(4)
    dim, heads, kv_heads, page, blocks = 16, 4, 2, 4, 5
    cos, sin, q, k, v = _rope_case(device, dtype, dim, [0, 5, 9, 2, 3], heads, kv_heads)
    weights = (1 + 0.1 * torch.randn(2, dim, device=device)).to(dtype) if with_norm else None
    qw = weights[0] if weights is not None else None
    kw = weights[1] if weights is not None else None
    slots = torch.tensor([3, 17, -1, 0, 9], dtype=torch.int64, device=device)
    ours_cache = torch.full((2, blocks, page, kv_heads, dim), 7.0, device=device).to(dtype)
    ref_cache = ours_cache.clone()
    q_ours, k_none = qk_norm_rope(
        q, k, cos, sin, qw, kw, 1e-6, v=v, kv_cache=ours_cache, slot_mapping=slots
    )
    q_ref, k_ref = qk_norm_rope_reference(q, k, cos, sin, qw, kw, 1e-6)
    write_kv_reference(k_ref, v, ref_cache, slots)
    assert k_none is None
    assert _close(q_ours, q_ref, dtype)
    assert _close(ours_cache, ref_cache, dtype)
    untouched = torch.ones(2 * blocks * page, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    untouched[blocks * page + slots[slots >= 0]] = False
    flat = ours_cache.view(2 * blocks * page, kv_heads, dim)
    assert bool((flat[untouched] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [16, 8])
def test_qk_norm_rope_writes_an_fp8_cache_as_write_kv_does(
    device: torch.device, dtype: torch.dtype, dim: int
) -> None:
    """Into an FP8 cache the kernel stores the bytes that rotary followed by `write_kv` stores:
    keys Hadamard-rotated where the head dim allows it (16; 8 is stored unrotated), both
    quantized with the layer's per-head scales, values key-minor in each block, padding slots
    untouched; and what it stores decodes to the unquantized keys and values within e4m3's
    rounding."""
    torch.manual_seed(6)
    heads, kv_heads, page, blocks = 4, 2, 4, 5
    cos, sin, q, k, v = _rope_case(device, dtype, dim, [0, 5, 9, 2, 3, 7], heads, kv_heads, 3.0)
    weights = (1 + 0.1 * torch.randn(2, dim, device=device)).to(dtype)
    slots = torch.tensor([3, 17, -1, 0, 9, 18], dtype=torch.int64, device=device)
    kv_scale = torch.tensor([[0.05, 0.2], [0.01, 0.3]], device=device)  # saturates some
    fused = torch.zeros(2, blocks, page, kv_heads, dim, device=device).to(torch.float8_e4m3fn)
    apart, ref = fused.clone(), fused.clone()
    q_fused, k_none = qk_norm_rope(
        q, k, cos, sin, weights[0], weights[1], 1e-6, v=v, kv_cache=fused, slot_mapping=slots,
        kv_scale=kv_scale,
    )  # fmt: skip
    q_apart, k_rot = qk_norm_rope(q, k, cos, sin, weights[0], weights[1], 1e-6)
    assert k_none is None and k_rot is not None
    assert torch.equal(q_fused, q_apart)
    write_kv(k_rot, v, apart, slots, kv_scale)
    assert torch.equal(fused.view(torch.uint8), apart.view(torch.uint8))
    write_kv_reference(k_rot, v, ref, slots, kv_scale)
    diff = (fused.float() - ref.float()).abs()
    assert float(diff.max()) <= 0.125 * float(ref.float().abs().max())  # one e4m3 step at most
    assert float((diff > 0).float().mean()) < 0.05
    untouched = torch.ones(2, blocks * page, dtype=torch.bool, device=device)
    untouched[:, slots[slots >= 0]] = False
    keys = fused[0].view(blocks * page, kv_heads, dim).float()
    assert bool((keys[untouched[0]] == 0).all()) and bool((keys[~untouched[0]] != 0).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_cache", [False, True])
def test_qk_norm_rope_rotates_queries(
    device: torch.device, dtype: torch.dtype, with_cache: bool
) -> None:
    """`rotate_queries` gives `q @ H` of the rotary output, rounded once to q's dtype (3 query
    heads: the tile is padded to the 16 rows a matrix product needs), and leaves the keys and
    the cache as they are without it."""
    from davit_engine.layers.fp8 import hadamard

    torch.manual_seed(8)
    dim, heads, kv_heads, page, blocks = 32, 3, 1, 4, 3
    cos, sin, q, k, v = _rope_case(device, dtype, dim, [0, 5, 9, 2], heads, kv_heads)
    weights = (1 + 0.1 * torch.randn(2, dim, device=device)).to(dtype)
    q_plain, k_plain = qk_norm_rope(q, k, cos, sin, weights[0], weights[1], 1e-6)
    expected = (q_plain.float() @ hadamard(dim, device)).to(dtype)
    if with_cache:
        slots = torch.tensor([3, -1, 0, 9], dtype=torch.int64, device=device)
        kv_scale = torch.tensor([[0.05], [0.02]], device=device)
        cache = torch.zeros(2, blocks, page, kv_heads, dim, device=device).to(torch.float8_e4m3fn)
        plain_cache = cache.clone()
        q_rot, k_none = qk_norm_rope(
            q, k, cos, sin, weights[0], weights[1], 1e-6, v=v, kv_cache=cache,
            slot_mapping=slots, kv_scale=kv_scale, rotate_queries=True,
        )  # fmt: skip
        qk_norm_rope(
            q, k, cos, sin, weights[0], weights[1], 1e-6, v=v, kv_cache=plain_cache,
            slot_mapping=slots, kv_scale=kv_scale,
        )  # fmt: skip
        assert k_none is None
        assert torch.equal(cache.view(torch.uint8), plain_cache.view(torch.uint8))
    else:
        q_rot, k_rot = qk_norm_rope(
            q, k, cos, sin, weights[0], weights[1], 1e-6, rotate_queries=True
        )
        assert k_rot is not None and k_plain is not None and torch.equal(k_rot, k_plain)
    ulp = 1e-6 if dtype == torch.float32 else 2.0**-10
    assert torch.allclose(q_rot.float(), expected.float(), rtol=ulp, atol=ulp)
    assert not torch.allclose(q_rot.float(), q_plain.float(), rtol=0.1, atol=0.1)


def _cache_write_case(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int]
) -> tuple[Any, ...]:
    """A rotary step that writes the cache (`shape`: tokens, query heads, KV heads, head dim):
    cos, sin, q, k, v, the q/k norm weights, each token's slot (one padding row, -1, where
    there are several tokens), the cache's blocks and page size."""
    tokens, heads, kv_heads, dim = shape
    page = 16
    blocks = -(-tokens // page) + 2
    positions = torch.randint(0, 12, (tokens,)).tolist()
    cos, sin, q, k, v = _rope_case(device, dtype, dim, positions, heads, kv_heads, 3.0)
    weights = (1 + 0.1 * torch.randn(2, dim, device=device)).to(dtype)
    slots = torch.randperm(blocks * page, device=device)[:tokens]
    if tokens > 1:
        slots[tokens // 3] = -1  # a padding row
    return cos, sin, q, k, v, weights, slots, blocks, page


def _rotary_run(
    case: tuple[Any, ...],
    cache_dtype: torch.dtype | None,
    kv_scale: torch.Tensor | None,
    rotate_queries: bool,
) -> tuple[torch.Tensor, ...]:
    """The rotary kernel on a `_cache_write_case`: (queries, keys) with no cache
    (`cache_dtype` None), else (queries, the cache written from zeros; an FP8 one as bytes)."""
    cos, sin, q, k, v, weights, slots, blocks, page = case
    if cache_dtype is None:
        q_out, k_out = qk_norm_rope(
            q, k, cos, sin, weights[0], weights[1], 1e-6, rotate_queries=rotate_queries
        )
        assert k_out is not None
        return q_out, k_out
    _, kv_heads, dim = k.shape
    cache = torch.zeros(2, blocks, page, kv_heads, dim, device=q.device).to(cache_dtype)
    q_out, _ = qk_norm_rope(
        q, k, cos, sin, weights[0], weights[1], 1e-6, v=v, kv_cache=cache,
        slot_mapping=slots, kv_scale=kv_scale, rotate_queries=rotate_queries,
    )  # fmt: skip
    return q_out, cache.view(torch.uint8) if cache_dtype == torch.float8_e4m3fn else cache


def _rotary_switch_case(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    from_memory: bool,
    warps: int,
    shape: tuple[int, int, int, int],
) -> None:
    """The rotary kernel with the FP8 cache, default launch against the switched one
    (`shape`: tokens, query heads, KV heads, head dim): the same rotated queries and cache
    bytes. Under Triton's interpreter exactly; on a GPU another warp count changes the matrix
    units' summation order, so a value may differ in its last place: a rotated query by one
    unit of the last place (bf16), a cache byte by one e4m3 step, in few places."""
    torch.manual_seed(12)
    _, _, kv_heads, dim = shape
    cos, sin, q, k, v, weights, slots, blocks, page = _cache_write_case(device, dtype, shape)
    kv_scale = (0.02 + 0.2 * torch.rand(2, kv_heads, device=device)).contiguous()

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.zeros(2, blocks, page, kv_heads, dim, device=device).to(torch.float8_e4m3fn)
        q_rot, _ = qk_norm_rope(
            q, k, cos, sin, weights[0], weights[1], 1e-6, v=v, kv_cache=cache,
            slot_mapping=slots, kv_scale=kv_scale, rotate_queries=True,
        )  # fmt: skip
        return q_rot, cache.view(torch.uint8)

    q_default, cache_default = run()
    default_warps = layer_ops.ROTARY_FP8_NUM_WARPS
    monkeypatch.setattr(layer_ops, "ROTARY_HADAMARD_FROM_MEMORY", from_memory)
    monkeypatch.setattr(layer_ops, "ROTARY_FP8_NUM_WARPS", warps)
    monkeypatch.setattr(layer_ops, "_HADAMARD", {})
    q_switched, cache_switched = run()
    assert bool(layer_ops._HADAMARD) == from_memory
    assert bool((cache_default != 0).any())
    if device.type != "cuda" or warps == default_warps:
        assert torch.equal(q_switched, q_default) and torch.equal(cache_switched, cache_default)
        return
    _assert_within_summation_order(q_switched, q_default, cache_switched, cache_default)


def _assert_within_summation_order(
    q_switched: torch.Tensor,
    q_default: torch.Tensor,
    cache_switched: torch.Tensor | None = None,
    cache_default: torch.Tensor | None = None,
) -> None:
    """Rotated queries and FP8 cache bytes (uint8 views; None: queries only) of two launches
    that sum the Hadamard products in another order on the matrix units: equal but for last
    places."""
    # A rotated query is a sum of a head's 128 products: where it nearly cancels, another
    # summation order moves it by several of its own last places, but by no more than about
    # one last place of the head's largest value. (H100, 256 tokens: 68 of 524,288 query
    # values differed, at most 4 of their own last places; no cache byte differed.)
    diff = (q_switched.float() - q_default.float()).abs()
    head_max = q_default.float().abs().amax(dim=-1, keepdim=True)
    summary = (
        f"queries: {int((diff > 0).sum())} of {diff.numel()} differ, at most"
        f" {float((diff / head_max).max()):.2e} of their head's largest"
    )
    if cache_switched is not None and cache_default is not None:
        # e4m3 bytes of one sign are ordered like their values: one step apart is one code.
        # Near zero e4m3's steps are far finer than a key row's largest value, so a key that
        # nearly cancels may move by several codes there and still by less than that row's
        # last place (H100, a chunk of 1,000 tokens in groups of 4: 3 of 2,129,920 bytes
        # moved by up to 19 codes).
        byte_steps = (cache_switched.int() - cache_default.int()).abs()
        values = [c.view(torch.float8_e4m3fn).float() for c in (cache_switched, cache_default)]
        value_diff = (values[0] - values[1]).abs()
        row_max = values[1].abs().amax(dim=-1, keepdim=True)
        near = (byte_steps <= 1) | (value_diff <= row_max * 2**-7)
        summary += (
            f"; cache: {int((byte_steps > 0).sum())} of {byte_steps.numel()} bytes differ, at"
            f" most {int(byte_steps.max())} steps, at most"
            f" {float((value_diff / row_max.clamp_min(1e-30)).max()):.2e} of their row's largest"
        )
        assert bool(near.all()), summary
        assert float((byte_steps > 0).float().mean()) < 0.01, summary
    assert bool((diff <= head_max * 2**-7).all()), summary
    assert float((diff > 0).float().mean()) < 0.01, summary


# every launch other than the default one (tile made in registers or read from memory; 4 or 8
# warps)
SWITCHES = [
    (from_memory, warps)
    for from_memory in (False, True)
    for warps in (4, 8)
    if (from_memory, warps)
    != (layer_ops.ROTARY_HADAMARD_FROM_MEMORY, layer_ops.ROTARY_FP8_NUM_WARPS)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("from_memory", "warps"), SWITCHES)
def test_rotary_launch_switches_store_the_same_bytes(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    from_memory: bool,
    warps: int,
) -> None:
    """The Hadamard tile made in registers or read from memory (`ROTARY_HADAMARD_FROM_MEMORY`)
    and 4 or 8 warps per program (`ROTARY_FP8_NUM_WARPS`) give the rotated queries and the FP8
    cache bytes of the default launch (tile from memory, 8 warps)."""
    _rotary_switch_case(device, monkeypatch, dtype, from_memory, warps, (5, 4, 2, 16))


@pytest.mark.gpu
@pytest.mark.parametrize(("from_memory", "warps"), SWITCHES)
def test_rotary_launch_switches_real_shapes(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, from_memory: bool, warps: int
) -> None:
    """The same at a W1 decode step on the GPU: 256 tokens, Qwen3-0.6B heads, bf16."""
    _rotary_switch_case(device, monkeypatch, torch.bfloat16, from_memory, warps, (256, 16, 8, 128))


def _rotary_equal_switch_case(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None,
    shape: tuple[int, int, int, int],
    switch: str = "ROTARY_LOADS_BEFORE_WAIT",
) -> None:
    """The rotary kernel with a boolean launch switch of layer_ops off and on: the same
    queries, keys and cache bytes (`cache_dtype` None: keys returned, no cache). The default
    switch: cos/sin rows, slots and Hadamard tile read before the wait or after it."""
    torch.manual_seed(13)
    _, _, kv_heads, dim = shape
    cos, sin, q, k, v, weights, slots, blocks, page = _cache_write_case(device, dtype, shape)
    fp8 = cache_dtype == torch.float8_e4m3fn
    kv_scale = (0.02 + 0.2 * torch.rand(2, kv_heads, device=device)).contiguous() if fp8 else None

    case = (cos, sin, q, k, v, weights, slots, blocks, page)

    def run() -> tuple[torch.Tensor, ...]:
        return _rotary_run(case, cache_dtype, kv_scale, rotate_queries=fp8)

    monkeypatch.setattr(layer_ops, switch, False)
    before = run()
    monkeypatch.setattr(layer_ops, switch, True)
    after = run()
    assert bool((before[1] != 0).any())
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


# The rotary kernel's launch switches that must not change a number: its loads before the
# wait for the kernel before, and two programs a token (queries | keys and values).
ROTARY_EQUAL_SWITCHES = ["ROTARY_LOADS_BEFORE_WAIT", "ROTARY_SPLIT_QK"]


@pytest.mark.parametrize("switch", ROTARY_EQUAL_SWITCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache_dtype", [None, "model", torch.float8_e4m3fn], ids=str)
def test_rotary_equal_switches_change_nothing(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | str | None,
    switch: str,
) -> None:
    cache = dtype if cache_dtype == "model" else cache_dtype
    assert cache is None or isinstance(cache, torch.dtype)
    _rotary_equal_switch_case(device, monkeypatch, dtype, cache, (5, 4, 2, 16), switch)


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ROTARY_EQUAL_SWITCHES)
@pytest.mark.parametrize("tokens", [1, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_rotary_equal_switches_real_shapes(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    tokens: int,
    cache_dtype: torch.dtype,
    switch: str,
) -> None:
    """The same at W2's one token (Llama-3.1-8B heads) and W1's 256 (Qwen3-0.6B heads)."""
    heads = (32, 8) if tokens == 1 else (16, 8)
    _rotary_equal_switch_case(
        device, monkeypatch, torch.bfloat16, cache_dtype, (tokens, *heads, 128), switch
    )


def _rotary_group_case(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None,
    shape: tuple[int, int, int, int],
    group: int,
    split: bool,
    warps: int = 8,
    rotate_queries: bool = True,
) -> None:
    """The rotary kernel where it rotates, one token a program against `group` tokens a
    program (`ROTARY_TOKEN_GROUP`; 0: chosen per launch) at `warps` warps: the same rotated
    queries, keys and cache bytes, but for the summation order of a taller product (the matrix
    units' on a GPU, numpy's under Triton's interpreter: see below). `cache_dtype` None: keys
    returned; `rotate_queries` False: only an FP8 cache's keys are rotated."""
    torch.manual_seed(14)
    _, _, kv_heads, dim = shape
    cos, sin, q, k, v, weights, slots, blocks, page = _cache_write_case(device, dtype, shape)
    fp8 = cache_dtype == torch.float8_e4m3fn
    kv_scale = (0.02 + 0.2 * torch.rand(2, kv_heads, device=device)).contiguous() if fp8 else None
    monkeypatch.setattr(layer_ops, "ROTARY_SPLIT_QK", split)

    case = (cos, sin, q, k, v, weights, slots, blocks, page)

    def run() -> tuple[torch.Tensor, ...]:
        return _rotary_run(case, cache_dtype, kv_scale, rotate_queries)

    monkeypatch.setattr(layer_ops, "ROTARY_TOKEN_GROUP", 1)
    one = run()
    monkeypatch.setattr(layer_ops, "ROTARY_TOKEN_GROUP", group)
    monkeypatch.setattr(layer_ops, "ROTARY_GROUP_NUM_WARPS", warps)
    if group == 0:  # chosen per launch: a group at this launch's tokens
        monkeypatch.setattr(layer_ops, "ROTARY_GROUP_MIN_TOKENS", shape[0])
    grouped = run()
    assert bool((one[1] != 0).any())
    if device.type != "cuda":
        # The interpreter multiplies with numpy, whose matrix product may sum a taller product
        # in another order (numpy 2.4: float32 queries moved by their last places, about 1e-7
        # of their head's largest); the cache bytes and the keys stay exact.
        diff = (grouped[0].float() - one[0].float()).abs()
        assert bool((diff <= one[0].float().abs().amax(dim=-1, keepdim=True) * 2**-18).all())
        assert torch.equal(grouped[1], one[1])
    elif fp8:
        _assert_within_summation_order(grouped[0], one[0], grouped[1], one[1])
    else:  # keys unrotated: exactly; the queries' products as for an FP8 cache
        assert torch.equal(grouped[1], one[1])
        _assert_within_summation_order(grouped[0], one[0])


@pytest.mark.parametrize("group", [2, 8, 0])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("cache_dtype", [None, "model", torch.float8_e4m3fn], ids=str)
def test_rotary_token_groups_store_the_same_bytes(
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
    cache_dtype: torch.dtype | str | None,
    split: bool,
    group: int,
) -> None:
    """Groups of 2 and 8 tokens (7 tokens: a last group short of full, a padding slot; 4 query
    heads and 2 KV heads: rows padded up to the product's 16) and the per-launch choice."""
    dtype = torch.float32
    cache = dtype if cache_dtype == "model" else cache_dtype
    assert cache is None or isinstance(cache, torch.dtype)
    _rotary_group_case(device, monkeypatch, dtype, cache, (7, 4, 2, 16), group, split)


@pytest.mark.parametrize("group", [2, 8])
def test_rotary_token_groups_with_queries_unrotated(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, group: int
) -> None:
    """An FP8 cache written by a caller that takes its queries unrotated (the attention kernel
    rotates them): only the keys go through the group's product."""
    _rotary_group_case(
        device, monkeypatch, torch.float32, torch.float8_e4m3fn, (7, 4, 2, 16), group, True,
        rotate_queries=False,
    )  # fmt: skip


def test_rotary_split_below_a_threshold(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ROTARY_SPLIT_MAX_TOKENS`: a launch below it takes two programs a token, one at it one
    program a token, and both store the same bytes."""
    torch.manual_seed(16)
    shape = (6, 4, 2, 16)
    cos, sin, q, k, v, weights, slots, blocks, page = _cache_write_case(
        device, torch.float32, shape
    )
    kv_scale = (0.02 + 0.2 * torch.rand(2, 2, device=device)).contiguous()
    case = (cos, sin, q, k, v, weights, slots, blocks, page)
    kernel = layer_ops._qk_norm_rope_kernel
    grids: list[tuple[int, ...]] = []

    class Recorded:  # the launches' grids, each launch run as it is
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(layer_ops, "_qk_norm_rope_kernel", Recorded())
    results = []
    for threshold in (6, 7):
        monkeypatch.setattr(layer_ops, "ROTARY_SPLIT_MAX_TOKENS", threshold)
        results.append(_rotary_run(case, torch.float8_e4m3fn, kv_scale, rotate_queries=True))
    assert grids == [(6, 1), (6, 2)]
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_rotary_token_group_must_be_a_power_of_two(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    cos, sin, q, k, _, weights, _, _, _ = _cache_write_case(device, torch.float32, (4, 4, 2, 16))
    for bad in (3, -2):
        monkeypatch.setattr(layer_ops, "ROTARY_TOKEN_GROUP", bad)
        with pytest.raises(ValueError, match="ROTARY_TOKEN_GROUP"):
            qk_norm_rope(q, k, cos, sin, weights[0], weights[1], 1e-6, rotate_queries=True)
    monkeypatch.setattr(layer_ops, "ROTARY_TOKEN_GROUP", 0)
    monkeypatch.setattr(layer_ops, "ROTARY_GROUP_MIN_TOKENS", 1)
    monkeypatch.setattr(layer_ops, "ROTARY_LARGE_LAUNCH_GROUP", 6)
    with pytest.raises(ValueError, match="ROTARY_LARGE_LAUNCH_GROUP"):
        qk_norm_rope(q, k, cos, sin, weights[0], weights[1], 1e-6, rotate_queries=True)


def test_rotary_token_group_per_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chosen per launch (the default): a group at prefill-sized launches, one token a
    program at decode steps; a fixed group everywhere."""
    monkeypatch.setattr(layer_ops, "ROTARY_TOKEN_GROUP", 0)
    large = layer_ops.ROTARY_LARGE_LAUNCH_GROUP
    assert large > 1
    assert layer_ops.rotary_token_group(1) == 1  # W2's one token
    assert layer_ops.rotary_token_group(256) == 1  # a W1 decode step
    assert layer_ops.rotary_token_group(layer_ops.ROTARY_GROUP_MIN_TOKENS - 1) == 1
    assert layer_ops.rotary_token_group(layer_ops.ROTARY_GROUP_MIN_TOKENS) == large
    assert layer_ops.rotary_token_group(8192) == large  # a W1 prefill chunk
    monkeypatch.setattr(layer_ops, "ROTARY_TOKEN_GROUP", 4)
    assert layer_ops.rotary_token_group(1) == 4


@pytest.mark.gpu
@pytest.mark.parametrize(("group", "warps"), [(2, 8), (4, 8), (2, 16), (4, 16), (0, 8)])
@pytest.mark.parametrize("tokens", [256, 1000])
def test_rotary_token_groups_real_shapes(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, tokens: int, group: int, warps: int
) -> None:
    """The same at W1's shapes on the GPU (Qwen3-0.6B heads, bf16, an FP8 cache): a decode
    step of 256 tokens and a chunk of 1,000 (a last group short of full)."""
    _rotary_group_case(
        device, monkeypatch, torch.bfloat16, torch.float8_e4m3fn, (tokens, 16, 8, 128), group,
        True, warps,
    )  # fmt: skip


def test_qk_norm_rope_refuses_to_rotate_a_head_dim_without_a_rotation(
    device: torch.device,
) -> None:
    q = torch.randn(2, 4, 8, device=device)
    k = torch.randn(2, 2, 8, device=device)
    cos = torch.ones(2, 8, device=device)
    with pytest.raises(ValueError, match="rotate_queries: a head dim of 8"):
        qk_norm_rope(q, k, cos, torch.zeros_like(cos), rotate_queries=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    x = torch.randn(6, 48, device=device).to(dtype)
    residual = (4 * torch.randn(6, 48, device=device)).to(dtype)
    weight = (1 + 0.1 * torch.randn(48, device=device)).to(dtype)
    normed, total = add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_total = add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(total, ref_total)  # one rounded add: bit-exact
    assert _close(normed, ref_normed, dtype)
    empty = torch.empty(0, 48, device=device, dtype=dtype)
    assert add_rms_norm(empty, empty, weight, 1e-5)[0].shape == (0, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    x = (3 * torch.randn(3, 2 * 1500, device=device)).to(dtype)
    assert _close(silu_mul(x), silu_mul_reference(x), dtype)


@pytest.mark.gpu
def test_bf16_real_shapes_match_reference_closely(device: torch.device) -> None:
    torch.manual_seed(3)
    dtype = torch.bfloat16
    x = torch.randn(256, 4096, device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(4096, device=device)).to(dtype)
    ours, ref = rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)
    assert float((ours != ref).float().mean()) < 0.01  # rare last-bit rounding differences
    gate_up = torch.randn(256, 2 * 14336, device=device, dtype=dtype)
    ours, ref = silu_mul(gate_up), silu_mul_reference(gate_up)
    assert float((ours != ref).float().mean()) < 0.01
    angles = torch.outer(torch.arange(4096.0), torch.rand(64)).to(device)
    emb = torch.cat((angles, angles), dim=-1)
    qkv = torch.randn(256, 48, 128, device=device, dtype=dtype)
    positions = torch.randint(0, 4096, (256,), device=device)
    cos, sin = emb.cos()[positions].to(dtype), emb.sin()[positions].to(dtype)
    nw = (1 + 0.1 * torch.randn(2, 128, device=device)).to(dtype)
    ours_qk = qk_norm_rope(qkv[:, :32], qkv[:, 32:40], cos, sin, nw[0], nw[1], 1e-6)
    ref_qk = qk_norm_rope_reference(qkv[:, :32], qkv[:, 32:40], cos, sin, nw[0], nw[1], 1e-6)
    for a, b in zip(ours_qk, ref_qk, strict=True):
        assert a is not None
        assert float((a != b).float().mean()) < 0.01
    from davit_engine.layers.fp8 import hadamard  # queries rotated for an FP8 cache

    q_rot, _ = qk_norm_rope(
        qkv[:, :32], qkv[:, 32:40], cos, sin, nw[0], nw[1], 1e-6, rotate_queries=True
    )
    expected = (ours_qk[0].float() @ hadamard(128, device)).to(dtype)
    assert float((q_rot != expected).float().mean()) < 0.01
    residual = torch.randn(256, 4096, device=device, dtype=dtype)
    ours_pair = add_rms_norm(x, residual, w, 1e-5)
    ref_pair = add_rms_norm_reference(x, residual, w, 1e-5)
    assert torch.equal(ours_pair[1], ref_pair[1])
    assert float((ours_pair[0] != ref_pair[0]).float().mean()) < 0.01
