"""Fused elementwise layer operations: RMSNorm, q/k norm + rotary embedding, SiLU-and-multiply.

The plain-torch layers spend several kernels each (casts, powers, means, concatenations); at
decode batch sizes every one is a few microseconds of launch and memory round trip, which adds up
to milliseconds per step over 28-32 layers. Each op here is one kernel that keeps the reference
layer's rounding points (an explicit cast to the activation dtype wherever the torch layer
produces a tensor of that dtype), so results match the reference up to float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from davit_engine.kernels.fp8 import hadamard_operand
from davit_engine.kernels.kv_cache import head_tile_rows, kv_scales, store_rows_kv
from davit_engine.kernels.pdl import gdc_enter, pdl_launch
from davit_engine.layers.fp8 import hadamard, is_fp8, rotates_keys

# The rotary kernel where it rotates (an FP8 cache's keys, and the queries for it): warps per
# program, and whether the Hadamard tile is read from a matrix in memory (32 KB at a head dim of
# 128 in bf16, in L2 after the first program) instead of made in registers. One program per
# token leaves a decode step of 256 tokens under two programs per multiprocessor, so a
# program's chain of instructions is what the step waits on. Compiled for sm_90 (Triton 3.6,
# Qwen3-0.6B heads, queries rotated, cache written), registers and instructions per thread:
# tile made in registers, 4 warps 148 and 2,320, 8 warps 92 and 1,552; read from memory, 4
# warps 164 and 1,672, 8 warps 92 and 1,048 (bf16 cache, no rotation: 40 and 488). On an H100
# (bench notes, run 24) W1 with an FP8 cache ran 3.0% faster with both switches on (25,862
# against 25,107 output tok/s, medians of three). 8 warps change the matrix units' summation
# order, so the rotated queries and cache bytes may differ from 4 warps' in the last place.
# Module constants so that a benchmark can run the engine each way.
ROTARY_FP8_NUM_WARPS = 8
ROTARY_HADAMARD_FROM_MEMORY = True
# Whether the rotary kernel reads its cos/sin rows, cache slots and Hadamard tile before its
# wait for the kernel before (programmatic dependent launch; kernels/pdl.py): one program per
# token, so at decode's few tokens its loads are a chain. Timed with the attention kernel's
# `LOADS_BEFORE_WAIT` (its comment has the figures). A switch so that a benchmark can run the
# engine each way.
ROTARY_LOADS_BEFORE_WAIT = True
# Whether the rotary kernel takes two programs a token, the queries in one and the keys and
# values (and the cache write) in the other, instead of one doing both in turn: at decode's
# few tokens a program's chain is the kernel's time (W2, FP8 cache: about 8 us a launch on an
# H100, run 25's profile). The same numbers either way. On: on an H100 (bench notes, run 27)
# W2 with FP8 weights and KV ran at 280.0, 281.4 and 281.3 decode tok/s against 277.2, 278.7
# and 278.7 in three calls (the same 256 tokens), and W1 with an FP8 cache was level (+1.3%
# and -0.3% in two calls' medians of three, +0.2% in the third call's warm round). A switch so
# that a benchmark can run the engine each way.
ROTARY_SPLIT_QK = True
# Launches of fewer tokens than this split (`ROTARY_SPLIT_QK`); the rest take one program a
# token. On an H100 (bench notes, run 32; an FP8 cache, queries rotated, in CUDA graphs) one
# program a token was faster from 64 tokens at Qwen3-0.6B's heads (16/8: 3.39 against 3.50 us
# at 64, 5.54 against 6.56 at 256) and only at 256 at Llama-3.1-8B's (32/8: 6.41 against 8.27;
# 4.23 against 3.55 at 64), and W1 with an FP8 cache split only below 64 tokens was level
# (28,360 output tok/s against 28,303, two rounds). So all launches split, as before. A switch
# so that a benchmark can run the engine each way.
ROTARY_SPLIT_MAX_TOKENS = 1 << 31
# Tokens a program of the rotary kernel takes where it rotates (an FP8 cache), all in one
# product with the Hadamard tile: the group's heads are the rows of one `[tokens x heads, D]`
# operand, so the 32 KB tile is read once a group and the matrix units take a taller product
# than one token's 16 rows (or 8 keys padded to 16). 0: chosen per launch (`rotary_token_group`:
# `ROTARY_LARGE_LAUNCH_GROUP` tokens where a launch has `ROTARY_GROUP_MIN_TOKENS` or more, one
# below); N: N tokens a program (a power of two). On an H100 (bench notes, run 31; Qwen3-0.6B
# heads, bf16, q/k norms, in CUDA graphs) a prefill chunk of 8,192 tokens took 128.1 us at 2
# tokens a program against 162.2 at one (50.2 for a bf16 cache, which does not rotate), and
# slower at 4 or 8 (191.7, 185.6; 16 warps no better); a decode step of 256 tokens took 7.0 us
# at 2 against 6.55 at one, so decode steps keep one token a program (W2's one token
# included). Each row's arithmetic is that of one token a program; on a GPU a taller product
# may sum a row's products in another order (a rotated query by about its head's last place).
# Switches so that a benchmark can run the engine each way.
ROTARY_TOKEN_GROUP = 0
ROTARY_LARGE_LAUNCH_GROUP = 2
ROTARY_GROUP_MIN_TOKENS = 1024
# Warps a program of a token group (more tokens, more rows: compiled for sm_90 by Triton 3.6
# at Qwen3-0.6B's heads with an FP8 cache, queries rotated, registers a thread: 2 tokens 164 at
# 8 warps and 100 at 16, 4 tokens 229 and 128, 8 tokens 255 with spills at 8 warps and 128
# with 120 bytes of stack at 16).
ROTARY_GROUP_NUM_WARPS = 8
_HADAMARD: dict[tuple[int, torch.dtype, str, int | None], torch.Tensor] = {}


def _hadamard_in_memory(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The Hadamard matrix for `hadamard_operand`, made once per device and dtype; None where
    it would have to be made inside a CUDA graph capture (a copy from the host cannot be
    captured: the kernel makes the tile in registers instead). The V2 runner's eager warm-up
    makes it before its capture."""
    key = (dim, dtype, device.type, device.index)
    matrix = _HADAMARD.get(key)
    if matrix is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        matrix = hadamard(dim, device, dtype).contiguous()
        _HADAMARD[key] = matrix
    return matrix


@triton.jit
def _round(x, DTYPE: tl.constexpr):  # type: ignore[no-untyped-def]
    # Where the torch layer materialises a tensor of the activation dtype.
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    residual_ptr,
    sum_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    num_heads,
    stride_t,
    stride_h,
    eps,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    row_valid = rows < num_rows
    mask = row_valid[:, None] & (dims[None, :] < DIM)
    src = (rows // num_heads).to(tl.int64) * stride_t + (rows % num_heads) * stride_h
    x = tl.load(x_ptr + src[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    dst = rows.to(tl.int64)[:, None] * DIM + dims[None, :]
    dtype = out_ptr.dtype.element_ty
    if ADD_RESIDUAL:  # the residual stream, materialised like torch's `a + b`, then normed
        r = tl.load(residual_ptr + dst, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dtype)
        tl.store(sum_ptr + dst, x.to(dtype), mask=mask)
    variance = tl.sum(x * x, 1) / DIM
    normed = _round(x * tl.rsqrt(variance + eps)[:, None], dtype)
    w = tl.load(weight_ptr + dims, mask=dims < DIM, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, (normed * w[None, :]).to(dtype), mask=mask)


def _rms_norm_rows(block_d: int, device: torch.device) -> int:
    """Rows per program. On a GPU one row of a model's hidden size (a tile of 16 rows of 2,048
    spilled registers: 49-245 us per call on an H200 instead of 1.5-17.5 us at one row; one row
    was also the fastest or within 0.3 us of it for hidden sizes 576-8,192 at 1-4,096 rows);
    16 rows of a head's width (q/k norms). Triton's interpreter runs programs one after
    another, so on the CPU 16 rows per program."""
    if device.type == "cuda" and block_d >= 512:
        return 1
    return 16


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    total: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    num_rows: int,
    num_heads: int,
    eps: float,
) -> None:
    dim = x.shape[-1]
    rows = _rms_norm_rows(triton.next_power_of_2(dim), x.device)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x,
        residual if residual is not None else x,
        total if total is not None else out,
        weight,
        out,
        num_rows,
        num_heads,
        x.stride(0),
        x.stride(1) if x.dim() == 3 else 0,
        eps,
        DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        ROWS=rows,
        ADD_RESIDUAL=residual is not None,
        num_warps=4,
        enable_fp_fusion=False,  # no fused multiply-add: keep torch's rounding
        **pdl_launch(x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2) + eps))` over the last dim of a 2-D `[T, D]` or 3-D
    `[T, H, D]` view (last dim contiguous); returns a contiguous tensor of x's shape."""
    assert x.stride(-1) == 1 and x.dim() in (2, 3)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_heads = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.shape[0] * num_heads
    if num_rows == 0:
        return out
    _launch_rms_norm(x, None, None, weight, out, num_rows, num_heads, eps)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch layer's computation (layers/norm.py)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + residual` (rounded to x's dtype), then RMSNorm of s: returns (norm(s), s).

    One kernel for a decoder layer's residual add and the RMSNorm that follows it; x and
    residual are contiguous `[T, D]` tensors of one dtype.
    """
    assert x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
    assert x.dim() == 2 and x.dtype == residual.dtype
    out = torch.empty_like(x)
    total = torch.empty_like(x)
    num_rows = x.shape[0]
    if num_rows == 0:
        return out, total
    _launch_rms_norm(x, residual, total, weight, out, num_rows, 1, eps)
    return out, total


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch layers' computation: the residual add, then layers/norm.py's RMSNorm."""
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


@triton.jit
def _norm_rope_heads(  # type: ignore[no-untyped-def]
    x_ptr,
    weight_ptr,
    token,
    stride_t,
    stride_h,
    num_heads,
    eps,
    c1,
    c2,
    s1,
    s2,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Both halves of every head of one token, normed (optionally) and rotated: fp32 values
    already rounded to DTYPE, `[BLOCK_H, HALF]` each."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    src = x_ptr + token.to(tl.int64) * stride_t + heads * stride_h + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    return norm_rope_halves(x1, x2, weight_ptr, eps, c1, c2, s1, s2, HAS_NORM, HALF, DTYPE)


@triton.jit
def norm_rope_halves(  # type: ignore[no-untyped-def]
    x1, x2, weight_ptr, eps, c1, c2, s1, s2, HAS_NORM: tl.constexpr, HALF: tl.constexpr,
    DTYPE: tl.constexpr,
):  # fmt: skip
    """Heads given as their halves (fp32 values of DTYPE, `[rows, HALF]` each): normed
    (optionally) and rotated, each rounding where the torch layers round: the arithmetic of the
    rotary kernel's `_norm_rope_heads`."""
    dims = tl.arange(0, HALF)[None, :]
    if HAS_NORM:  # per-head RMSNorm (Qwen3's q_norm / k_norm), rounded like the torch layer
        variance = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        inv = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(weight_ptr + dims).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + dims).to(tl.float32)
        x1 = _round(_round(x1 * inv, DTYPE) * w1, DTYPE)
        x2 = _round(_round(x2 * inv, DTYPE) * w2, DTYPE)
    # rotate-half: out = x * cos + cat(-x2, x1) * sin, each product materialised like torch's
    out1 = _round(_round(x1 * c1, DTYPE) + _round(-x2 * s1, DTYPE), DTYPE)
    out2 = _round(_round(x2 * c2, DTYPE) + _round(x1 * s2, DTYPE), DTYPE)
    return out1, out2


@triton.jit
def _store_heads(  # type: ignore[no-untyped-def]
    dst_ptr,
    row_stride,
    out1,
    out2,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Store `[BLOCK_H, HALF]` halves as contiguous heads of 2 * HALF starting at dst_ptr."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    dst = dst_ptr + heads * row_stride + dims
    tl.store(dst, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _join_halves(x1, x2, BLOCK_H: tl.constexpr, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
    """`[BLOCK_H, HALF]` halves as whole heads, `[BLOCK_H, 2 * HALF]`."""
    return tl.reshape(tl.permute(tl.join(x1, x2), (0, 2, 1)), (BLOCK_H, 2 * HALF))


@triton.jit
def _qk_norm_rope_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    cache_ptr,
    slot_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    scale_ptr,
    h_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rope,
    value_offset,
    num_q_heads,
    num_k_heads,
    num_tokens,
    eps,
    HAS_NORM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PAGE: tl.constexpr,
    FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    ROTATE_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    H_FROM_MEMORY: tl.constexpr,
    EARLY: tl.constexpr,
    SPLIT_QK: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_HQ: tl.constexpr,
    GROUP_HK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    if GROUP > 1:
        _qk_norm_rope_group(
            q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr, q_weight_ptr,
            k_weight_ptr, cos_ptr, sin_ptr, scale_ptr, h_ptr, stride_qt, stride_qh, stride_kt,
            stride_kh, stride_vt, stride_vh, stride_rope, value_offset, num_q_heads, num_k_heads,
            num_tokens, eps, HAS_NORM, WRITE_KV, HALF, PAGE, FP8, ROTATE, ROTATE_Q,
            DOT_PRECISION, H_FROM_MEMORY, SPLIT_QK, GROUP, GROUP_HQ, GROUP_HK, USE_GDC,
        )  # fmt: skip
    else:
        _qk_norm_rope_token(
            q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr, q_weight_ptr,
            k_weight_ptr, cos_ptr, sin_ptr, scale_ptr, h_ptr, stride_qt, stride_qh, stride_kt,
            stride_kh, stride_vt, stride_vh, stride_rope, value_offset, num_q_heads, num_k_heads,
            eps, HAS_NORM, WRITE_KV, HALF, BLOCK_HQ, BLOCK_HK, PAGE, FP8, ROTATE, ROTATE_Q,
            DOT_PRECISION, H_FROM_MEMORY, EARLY, SPLIT_QK, USE_GDC,
        )  # fmt: skip


@triton.jit
def _qk_norm_rope_token(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr, q_weight_ptr, k_weight_ptr,
    cos_ptr, sin_ptr, scale_ptr, h_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_rope, value_offset, num_q_heads, num_k_heads, eps,
    HAS_NORM: tl.constexpr, WRITE_KV: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, ROTATE: tl.constexpr,
    ROTATE_Q: tl.constexpr, DOT_PRECISION: tl.constexpr, H_FROM_MEMORY: tl.constexpr,
    EARLY: tl.constexpr, SPLIT_QK: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """One token a program (or two: SPLIT_QK)."""
    # SPLIT_QK: two programs a token, the queries in one (axis 1 = 0), the keys and values in
    # the other (= 1); else one program does both.
    # EARLY: the token's cos/sin rows, its cache slot and the Hadamard tile are read before
    # the wait for the kernel before (none of them is its output; pdl.py), so only q, k and v
    # are loaded after it.
    if not EARLY:
        gdc_enter(USE_GDC)
    token = tl.program_id(0)
    dims = tl.arange(0, HALF)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    row = token.to(tl.int64) * stride_rope
    c1 = _round(tl.load(cos_ptr + row + dims).to(tl.float32), dtype)
    c2 = _round(tl.load(cos_ptr + row + HALF + dims).to(tl.float32), dtype)
    s1 = _round(tl.load(sin_ptr + row + dims).to(tl.float32), dtype)
    s2 = _round(tl.load(sin_ptr + row + HALF + dims).to(tl.float32), dtype)
    slot = tl.load(slot_ptr + token).to(tl.int64) if WRITE_KV else 0  # negative: padding
    # one Hadamard tile for the queries' and the keys' products
    h = hadamard_operand(h_ptr, 2 * HALF, dtype, H_FROM_MEMORY) if ROTATE or ROTATE_Q else 0
    # the keys' program's cache scales, a head a row (an FP8 cache)
    kv_heads = tl.arange(0, BLOCK_HK)[:, None]
    k_scale, v_scale = kv_scales(
        scale_ptr, kv_heads, kv_heads < num_k_heads, num_k_heads, WRITE_KV and FP8
    )
    if EARLY:
        gdc_enter(USE_GDC)
    # this program's parts: [first, last) of (queries, keys and values). Keep this form: for
    # sm_90 at W2's heads (FP8 cache, 8 warps) it compiles to 148 registers, where the same
    # choice written as `part != 1` / `part != 0` tests compiles to 250.
    first = tl.program_id(1) if SPLIT_QK else 0
    last = first + 1 if SPLIT_QK else 2
    if first == 0:
        _rope_queries(
            q_ptr, q_out_ptr, q_weight_ptr, token, stride_qt, stride_qh, num_q_heads, eps,
            c1, c2, s1, s2, h, HAS_NORM, HALF, BLOCK_HQ, ROTATE_Q, DOT_PRECISION, dtype,
        )  # fmt: skip
    if last == 2:
        _rope_keys_values(
            k_ptr, v_ptr, k_out_ptr, cache_ptr, k_weight_ptr, k_scale, v_scale, token, slot,
            stride_kt, stride_kh, stride_vt, stride_vh, value_offset, num_k_heads, eps,
            c1, c2, s1, s2, h, HAS_NORM, WRITE_KV, HALF, BLOCK_HK, PAGE, FP8, ROTATE,
            DOT_PRECISION, dtype,
        )  # fmt: skip


@triton.jit
def _rope_queries(  # type: ignore[no-untyped-def]
    q_ptr, q_out_ptr, q_weight_ptr, token, stride_qt, stride_qh, num_q_heads, eps,
    c1, c2, s1, s2, h, HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    ROTATE_Q: tl.constexpr, DOT_PRECISION: tl.constexpr, dtype: tl.constexpr,
):  # fmt: skip
    """The token's queries: normed (HAS_NORM), rotary, and (ROTATE_Q) times H."""
    q1, q2 = _norm_rope_heads(
        q_ptr, q_weight_ptr, token, stride_qt, stride_qh, num_q_heads, eps,
        c1, c2, s1, s2, HAS_NORM, HALF, BLOCK_HQ, dtype,
    )  # fmt: skip
    q_dst = q_out_ptr + token.to(tl.int64) * num_q_heads * 2 * HALF
    if ROTATE_Q:  # q @ H, rounded to the model dtype: what attention would otherwise compute
        q = _join_halves(q1, q2, BLOCK_HQ, HALF).to(dtype)
        q = tl.dot(q, h, input_precision=DOT_PRECISION)
        q_heads = tl.arange(0, BLOCK_HQ)[:, None]
        q_dims = tl.arange(0, 2 * HALF)[None, :]
        tl.store(q_dst + q_heads * 2 * HALF + q_dims, q.to(dtype), mask=q_heads < num_q_heads)
    else:
        _store_heads(q_dst, 2 * HALF, q1, q2, num_q_heads, HALF, BLOCK_HQ)


@triton.jit
def _rope_keys_values(  # type: ignore[no-untyped-def]
    k_ptr, v_ptr, k_out_ptr, cache_ptr, k_weight_ptr, k_scale, v_scale, token, slot,
    stride_kt, stride_kh, stride_vt, stride_vh, value_offset, num_k_heads, eps,
    c1, c2, s1, s2, h, HAS_NORM: tl.constexpr, WRITE_KV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HK: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, ROTATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, dtype: tl.constexpr,
):  # fmt: skip
    """The token's keys: normed (HAS_NORM) and rotary, then with its values into the paged
    cache at `slot` (WRITE_KV; negative: padding, skipped), or returned. The values are read
    beside the keys, before any arithmetic, and an FP8 cache's scales (`[BLOCK_HK, 1]` each)
    come read already (before the wait for the kernel before), so the store is not a second
    round trip to memory; the bytes are `write_kv`'s (`store_rows_kv`)."""
    heads = tl.arange(0, BLOCK_HK)[:, None]
    full = tl.arange(0, 2 * HALF)[None, :]
    if WRITE_KV:
        stored = (heads < num_k_heads) & (heads * 0 + slot >= 0)  # slot < 0: padding
        v_src = v_ptr + token.to(tl.int64) * stride_vt + heads * stride_vh + full
        v = tl.load(v_src, mask=stored, other=0.0)
    k1, k2 = _norm_rope_heads(
        k_ptr, k_weight_ptr, token, stride_kt, stride_kh, num_k_heads, eps,
        c1, c2, s1, s2, HAS_NORM, HALF, BLOCK_HK, dtype,
    )  # fmt: skip
    if WRITE_KV:
        # Straight into the paged cache at the token's slot.
        if FP8:  # quantized (keys rotated) by the code `write_kv` runs: the same bytes
            k = _join_halves(k1, k2, BLOCK_HK, HALF).to(dtype)
            store_rows_kv(
                k, v, cache_ptr, slot, heads, stored, k_scale, v_scale, value_offset,
                num_k_heads, PAGE, 2 * HALF, 2 * HALF, True, ROTATE, DOT_PRECISION, h,
            )  # fmt: skip
        else:
            k_dst = cache_ptr + slot * num_k_heads * 2 * HALF
            live_heads = tl.where(slot >= 0, num_k_heads, 0)
            _store_heads(k_dst, 2 * HALF, k1, k2, live_heads, HALF, BLOCK_HK)
            v_dst = k_dst + value_offset + heads * 2 * HALF + full
            tl.store(v_dst, v.to(cache_ptr.dtype.element_ty), mask=stored)
    else:
        k_dst = k_out_ptr + token.to(tl.int64) * num_k_heads * 2 * HALF
        _store_heads(k_dst, 2 * HALF, k1, k2, num_k_heads, HALF, BLOCK_HK)


@triton.jit
def _group_rows(  # type: ignore[no-untyped-def]
    first_token, num_tokens, num_heads, GROUP: tl.constexpr, HEADS: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """A token group's rows, `[ROWS, 1]` each: row r is head r % HEADS of token
    `first_token + r // HEADS` (HEADS: the heads padded to a power of two); valid where that is
    a real head of a real token of the group (ROWS may pad GROUP x HEADS up to a product's 16)."""
    r = tl.arange(0, ROWS)[:, None]
    tokens = first_token + r // HEADS
    heads = r % HEADS
    valid = (heads < num_heads) & (tokens < num_tokens) & (r < GROUP * HEADS)
    return tokens.to(tl.int64), heads, valid


@triton.jit
def _norm_rope_rows(  # type: ignore[no-untyped-def]
    x_ptr, weight_ptr, tokens, heads, valid, stride_t, stride_h, eps, cos_ptr, sin_ptr,
    stride_rope, HAS_NORM: tl.constexpr, HALF: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """`_norm_rope_heads` for rows of several tokens: each row a head, normed (optionally) and
    rotated with its own token's cos/sin row; fp32 values rounded to DTYPE, `[rows, HALF]`
    halves (invalid rows zero)."""
    dims = tl.arange(0, HALF)[None, :]
    src = x_ptr + tokens * stride_t + heads * stride_h + dims
    x1 = tl.load(src, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=valid, other=0.0).to(tl.float32)
    row = tokens * stride_rope
    c1 = _round(tl.load(cos_ptr + row + dims, mask=valid, other=0.0).to(tl.float32), DTYPE)
    c2 = _round(tl.load(cos_ptr + row + HALF + dims, mask=valid, other=0.0).to(tl.float32), DTYPE)
    s1 = _round(tl.load(sin_ptr + row + dims, mask=valid, other=0.0).to(tl.float32), DTYPE)
    s2 = _round(tl.load(sin_ptr + row + HALF + dims, mask=valid, other=0.0).to(tl.float32), DTYPE)
    return norm_rope_halves(x1, x2, weight_ptr, eps, c1, c2, s1, s2, HAS_NORM, HALF, DTYPE)


@triton.jit
def _group_heads(  # type: ignore[no-untyped-def]
    x_ptr, weight_ptr, first_token, num_tokens, num_heads, stride_t, stride_h, eps, cos_ptr,
    sin_ptr, stride_rope, HAS_NORM: tl.constexpr, HALF: tl.constexpr, GROUP: tl.constexpr,
    HEADS: tl.constexpr, ROWS: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """A token group's heads of x as rows (`_group_rows`), normed and rotated
    (`_norm_rope_rows`): tokens, heads, valid and the two halves."""
    tokens, heads, valid = _group_rows(first_token, num_tokens, num_heads, GROUP, HEADS, ROWS)
    x1, x2 = _norm_rope_rows(
        x_ptr, weight_ptr, tokens, heads, valid, stride_t, stride_h, eps, cos_ptr, sin_ptr,
        stride_rope, HAS_NORM, HALF, DTYPE,
    )  # fmt: skip
    return tokens, heads, valid, x1, x2


@triton.jit
def _store_rows(  # type: ignore[no-untyped-def]
    dst_ptr, tokens, heads, valid, num_heads, out1, out2, HALF: tl.constexpr,
):  # fmt: skip
    """Store rows' halves as heads of `[T, num_heads, 2 * HALF]` contiguous tokens."""
    dims = tl.arange(0, HALF)[None, :]
    dst = dst_ptr + (tokens * num_heads + heads) * (2 * HALF) + dims
    tl.store(dst, out1.to(dst_ptr.dtype.element_ty), mask=valid)
    tl.store(dst + HALF, out2.to(dst_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _qk_norm_rope_group(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr, q_weight_ptr, k_weight_ptr,
    cos_ptr, sin_ptr, scale_ptr, h_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_rope, value_offset, num_q_heads, num_k_heads, num_tokens, eps,
    HAS_NORM: tl.constexpr, WRITE_KV: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    FP8: tl.constexpr, ROTATE: tl.constexpr, ROTATE_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr, H_FROM_MEMORY: tl.constexpr, SPLIT_QK: tl.constexpr,
    GROUP: tl.constexpr, GROUP_HQ: tl.constexpr, GROUP_HK: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """GROUP tokens a program (`ROTARY_TOKEN_GROUP`), their heads the rows of one product with
    the Hadamard tile: the queries' rows in one (SPLIT_QK: its own program), the keys' in
    another, each row's arithmetic that of `_qk_norm_rope_token`. Only the tile is read before
    the wait for the kernel before. A group's rows: GROUP x the heads padded to a power of two
    (GROUP_HQ, GROUP_HK), at least the 16 a matrix-unit product takes."""
    ROWS_Q: tl.constexpr = GROUP * GROUP_HQ if GROUP * GROUP_HQ >= 16 else 16
    ROWS_K: tl.constexpr = GROUP * GROUP_HK if GROUP * GROUP_HK >= 16 else 16
    dtype = q_out_ptr.dtype.element_ty
    h = hadamard_operand(h_ptr, 2 * HALF, dtype, H_FROM_MEMORY) if ROTATE or ROTATE_Q else 0
    gdc_enter(USE_GDC)
    first_token = tl.program_id(0) * GROUP
    first = tl.program_id(1) if SPLIT_QK else 0
    last = first + 1 if SPLIT_QK else 2
    full = tl.arange(0, 2 * HALF)[None, :]
    if first == 0:
        tokens, heads, valid, q1, q2 = _group_heads(
            q_ptr, q_weight_ptr, first_token, num_tokens, num_q_heads, stride_qt, stride_qh,
            eps, cos_ptr, sin_ptr, stride_rope, HAS_NORM, HALF, GROUP, GROUP_HQ, ROWS_Q,
            dtype,
        )  # fmt: skip
        if ROTATE_Q:  # q @ H, rounded to the model dtype
            q = _join_halves(q1, q2, ROWS_Q, HALF).to(dtype)
            q = tl.dot(q, h, input_precision=DOT_PRECISION)
            dst = q_out_ptr + (tokens * num_q_heads + heads) * (2 * HALF) + full
            tl.store(dst, q.to(dtype), mask=valid)
        else:
            _store_rows(q_out_ptr, tokens, heads, valid, num_q_heads, q1, q2, HALF)
    if last == 2:
        tokens, heads, valid, k1, k2 = _group_heads(
            k_ptr, k_weight_ptr, first_token, num_tokens, num_k_heads, stride_kt, stride_kh,
            eps, cos_ptr, sin_ptr, stride_rope, HAS_NORM, HALF, GROUP, GROUP_HK, ROWS_K,
            dtype,
        )  # fmt: skip
        if WRITE_KV:  # straight into the paged cache at each token's slot (negative: padding)
            slot = tl.load(slot_ptr + tokens, mask=valid, other=-1).to(tl.int64)
            stored = valid & (slot >= 0)
            v = tl.load(
                v_ptr + tokens * stride_vt + heads * stride_vh + full, mask=stored, other=0.0
            )
            k = _join_halves(k1, k2, ROWS_K, HALF).to(dtype)
            k_scale, v_scale = kv_scales(scale_ptr, heads, stored, num_k_heads, FP8)
            store_rows_kv(
                k, v, cache_ptr, slot, heads, stored, k_scale, v_scale, value_offset,
                num_k_heads, PAGE, 2 * HALF, 2 * HALF, FP8, ROTATE, DOT_PRECISION, h,
            )  # fmt: skip
        else:
            _store_rows(k_out_ptr, tokens, heads, valid, num_k_heads, k1, k2, HALF)


def rotary_token_group(num_tokens: int) -> int:
    """Tokens a program of a rotating launch of `num_tokens` takes (`ROTARY_TOKEN_GROUP`; 0:
    `ROTARY_LARGE_LAUNCH_GROUP` at `ROTARY_GROUP_MIN_TOKENS` tokens or more, else one)."""
    if ROTARY_TOKEN_GROUP:
        return ROTARY_TOKEN_GROUP
    return ROTARY_LARGE_LAUNCH_GROUP if num_tokens >= ROTARY_GROUP_MIN_TOKENS else 1


def qk_norm_rope(
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    k: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    cos: torch.Tensor,  # [T, D] (or [T, 1, D]), rows contiguous
    sin: torch.Tensor,  # like cos
    q_weight: torch.Tensor | None = None,  # [D]: per-head RMSNorm weights (Qwen3), or None
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,  # [T, Hkv, D]: with kv_cache, written beside the keys
    kv_cache: torch.Tensor | None = None,  # [2, num_blocks, block_size, Hkv, D], contiguous
    slot_mapping: torch.Tensor | None = None,  # [T] int64, negative = padding
    kv_scale: torch.Tensor | None = None,  # [2, Hkv] float32: needed for an FP8 cache
    rotate_queries: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Optional per-head RMSNorm of q and k, then rotate-half rotary: two programs per token
    (`ROTARY_SPLIT_QK`, the default, at launches of fewer than `ROTARY_SPLIT_MAX_TOKENS`
    tokens: the queries in one, the keys, values and cache write in the other), or one doing
    both in turn; where it rotates, a program may take a group of tokens instead of one
    (`ROTARY_TOKEN_GROUP`).

    Returns (q, k). With `kv_cache` (and `v`, `slot_mapping`) the rotated keys and the values go
    straight into the paged cache at each token's slot, as `kernels.kv_cache.write_kv` would
    store them (an FP8 cache quantized with `kv_scale`, keys rotated, values key-minor: the
    same bytes), and no key tensor is returned (None).

    `rotate_queries` returns `q @ H` (H the Hadamard matrix of the head dim, unnormalised),
    rounded to q's dtype: the queries an FP8 cache's rotated keys are matched with, which
    `paged_attention(..., queries_rotated=True)` takes instead of rotating them itself.
    """
    num_tokens, num_q_heads, dim = q.shape
    if rotate_queries and not rotates_keys(dim):
        raise ValueError(
            f"rotate_queries: a head dim of {dim} is not rotated (a power of two in [16, 256] is)"
        )
    write_kv = kv_cache is not None
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = None if write_kv else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    cos = cos.reshape(num_tokens, dim)
    sin = sin.reshape(num_tokens, dim)
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert cos.stride(0) == sin.stride(0)
    assert dim % 2 == 0 and triton.next_power_of_2(dim // 2) == dim // 2
    if write_kv:
        assert v is not None and slot_mapping is not None and kv_cache is not None
        assert kv_cache.is_contiguous() and v.stride(2) == 1
        assert tuple(kv_cache.shape[3:]) == (k.shape[1], dim)
    fp8 = kv_cache is not None and is_fp8(kv_cache.dtype)
    if fp8:
        assert kv_scale is not None and tuple(kv_scale.shape) == (2, k.shape[1])
        assert kv_scale.dtype == torch.float32 and kv_scale.is_contiguous()
    rotate = fp8 and rotates_keys(dim)
    has_norm = q_weight is not None and k_weight is not None
    rotates = rotate or rotate_queries  # the launch takes the Hadamard tile
    h_matrix = None
    if rotates and ROTARY_HADAMARD_FROM_MEMORY:
        h_matrix = _hadamard_in_memory(dim, q.dtype, q.device)
    split = ROTARY_SPLIT_QK and num_tokens < ROTARY_SPLIT_MAX_TOKENS
    parts = 2 if split else 1
    group = rotary_token_group(num_tokens) if rotates else 1
    if group < 1 or group & (group - 1):
        raise ValueError(
            "ROTARY_TOKEN_GROUP and ROTARY_LARGE_LAUNCH_GROUP must be powers of two"
            f" (ROTARY_TOKEN_GROUP 0: chosen per launch; got {group})"
        )
    _qk_norm_rope_kernel[(triton.cdiv(num_tokens, group), parts)](
        q,
        k,
        v if v is not None else k,
        q_out,
        k_out if k_out is not None else q_out,
        kv_cache if kv_cache is not None else q_out,
        slot_mapping if slot_mapping is not None else q_out,
        q_weight if q_weight is not None else q,
        k_weight if k_weight is not None else k,
        cos,
        sin,
        kv_scale if fp8 else cos,
        h_matrix if h_matrix is not None else q,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0) if v is not None else 0,
        v.stride(1) if v is not None else 0,
        cos.stride(0),
        kv_cache[0].numel() if kv_cache is not None else 0,
        num_q_heads,
        k.shape[1],
        num_tokens,
        eps,
        HAS_NORM=has_norm,
        WRITE_KV=write_kv,
        HALF=dim // 2,
        BLOCK_HQ=head_tile_rows(num_q_heads, rotate_queries),
        BLOCK_HK=head_tile_rows(k.shape[1], rotate),
        PAGE=kv_cache.shape[2] if kv_cache is not None else 1,
        FP8=fp8,
        ROTATE=rotate,
        ROTATE_Q=rotate_queries,
        DOT_PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
        H_FROM_MEMORY=h_matrix is not None,
        EARLY=ROTARY_LOADS_BEFORE_WAIT,
        SPLIT_QK=split,
        GROUP=group,
        GROUP_HQ=triton.next_power_of_2(num_q_heads),
        GROUP_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=ROTARY_GROUP_NUM_WARPS if group > 1 else ROTARY_FP8_NUM_WARPS if rotates else 4,
        enable_fp_fusion=False,
        **pdl_launch(q.device),
    )
    return q_out, k_out


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch layers' computation (layers/norm.py, then layers/rotary.py)."""
    if q_weight is not None and k_weight is not None:
        q = rms_norm_reference(q, q_weight, eps)
        k = rms_norm_reference(k, k_weight, eps)
    cos = cos.reshape(q.shape[0], 1, -1).to(q.dtype)
    sin = sin.reshape(q.shape[0], 1, -1).to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


@triton.jit
def _silu_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    width,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * width + cols, silu_times(gate, up, dtype).to(dtype), mask=mask)


@triton.jit
def silu_times(gate, up, DTYPE: tl.constexpr):  # type: ignore[no-untyped-def]
    """`silu(gate) * up` in float32 for float32 `gate` and `up` that hold values of `DTYPE`,
    rounding the activation to `DTYPE` where the torch layer materialises it; the caller casts
    the product. One definition for every kernel that applies the MLP's gate, so they agree bit
    for bit (compile them without fp fusion: `enable_fp_fusion=False`)."""
    act = _round(gate / (1.0 + tl.exp(-gate)), DTYPE)
    return act * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up = [gate | up]` of shape [T, 2I] (contiguous) -> [T, I]."""
    assert gate_up.is_contiguous()
    num_tokens, double = gate_up.shape
    width = double // 2
    out = torch.empty(num_tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = 1024
    _silu_mul_kernel[(num_tokens, triton.cdiv(width, block))](
        gate_up, out, width, BLOCK=block, num_warps=4, enable_fp_fusion=False,
        **pdl_launch(gate_up.device),
    )  # fmt: skip
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up
