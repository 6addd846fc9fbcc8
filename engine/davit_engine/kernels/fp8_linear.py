"""FP8-weight matrix products: `y = (x @ W_fp8^T) * w_scale (+ bias)`, and per-token FP8
quantization of activations for the library's FP8 GEMM.

Kernels, each beside its plain-torch reference:
- `fp8_weight_matmul`: weights stored in FP8 with one scale per output channel (row of W),
  activations not quantized. Up to `fp8_gemv.MAX_ROWS` rows (decode) it runs the
  matrix-vector kernel of `kernels/fp8_gemv.py`, which streams W at memory bandwidth. Beyond,
  a matrix-unit kernel: each tile of W is widened to fp16 with the hardware conversion (exact:
  every e4m3 value is an fp16 value) and multiplied with the activations in fp16 (clamped to
  its range; fp32 activations stay fp32) with float32 accumulation; the channel scale applies
  once to the result. At a few rows the product is bound by reading W, so this reads half the
  bytes of a bf16 weight and needs no quantization of the activations.
- `quantize_rows`: x [M, K] -> FP8 rows and one float32 scale per row (`amax / 448`), for
  `torch._scaled_mm` at many rows (prefill), where FP8 matrix units double the rate.
- `dequantized_matmul`: where many rows multiply a weight whose activations are not quantized
  (q/k/v at prefill), W widened to the activation dtype (exact: every e4m3 value is a bf16 and
  an fp16 value) in a transient copy and the library's GEMM, then the channel scale (and bias)
  on its output: with the copy made by a Triton kernel, faster than the matrix-unit tile above
  from a few hundred rows (bench notes, run 24; made by torch's FP8 conversion it was slower,
  run 25). The output is rounded twice (the GEMM's result, then scaled), where the tile rounds
  once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from davit_engine.kernels import fp8_gemv, interpreted
from davit_engine.kernels.fp8 import round_to_e4m3, to_f16_saturated
from davit_engine.kernels.pdl import gdc_enter, pdl_launch
from davit_engine.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_fp8


@dataclass(frozen=True)
class MatmulConfig:
    """Tile shape and launch options of `fp8_weight_matmul`."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Few rows (past fp8_gemv.MAX_ROWS, up to 16): BLOCK_M is the smallest matrix-unit tile; long
# K tiles keep several of W's bytes in flight per program. 32 columns per program: on the H200
# at one row it beat 16 by 1.4-2.2x at W2's four projection shapes, docs/bench-notes.md run 9.
SMALL_ROWS_CONFIG = MatmulConfig(block_m=16, block_n=32, block_k=512, num_warps=4, num_stages=4)
# Many rows (prefill where the FP8 library GEMM is not used): a compute-shaped tile.
LARGE_ROWS_CONFIG = MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)


def default_config(num_rows: int) -> MatmulConfig:
    return SMALL_ROWS_CONFIG if num_rows <= SMALL_ROWS_CONFIG.block_m else LARGE_ROWS_CONFIG


@triton.jit
def _fp8_weight_matmul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    N,
    K,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    F16_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < num_rows
    col_valid = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[None, :] * K  # W^T tile: [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = (k0 + ks) < K
        x = tl.load(
            x_rows + (k0 + ks)[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0
        )
        w = tl.load(
            w_rows + (k0 + ks)[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0
        )
        # e4m3 widens exactly to fp16 (and fp32): W adds no rounding of its own.
        if F16_DOT:
            acc = tl.dot(to_f16_saturated(x), w.to(tl.float16), acc)
        else:
            acc = tl.dot(x, w.to(tl.float32), acc, input_precision=DOT_PRECISION)
    scale = tl.load(scale_ptr + cols, mask=col_valid, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def fp8_weight_matmul(
    x: torch.Tensor,  # [M, K], rows contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    config: MatmulConfig | fp8_gemv.GemvConfig | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """`(x @ weight^T) * weight_scale + bias` with float32 accumulation: the matrix-vector
    kernel up to `fp8_gemv.MAX_ROWS` rows (or when `config` is a `GemvConfig`), else the
    matrix-unit kernel."""
    if isinstance(config, fp8_gemv.GemvConfig) or (
        config is None and x.shape[0] <= fp8_gemv.MAX_ROWS
    ):
        return fp8_gemv.fp8_gemv(x, weight, weight_scale, bias, config)
    num_rows, k = x.shape
    n = weight.shape[0]
    assert (
        weight.dtype in fp8_gemv.WEIGHT_DTYPES and weight.is_contiguous() and weight.shape[1] == k
    )
    assert x.stride(1) == 1 and weight_scale.dtype == torch.float32
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    cfg = config or default_config(num_rows)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(num_rows, cfg.block_m))
    _fp8_weight_matmul_kernel[grid](
        x,
        weight,
        weight_scale,
        bias if bias is not None else weight_scale,
        out,
        num_rows,
        n,
        k,
        x.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        F16_DOT=x.dtype != torch.float32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(x.device),
    )
    return out


def fp8_weight_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `fp8_weight_matmul`: the product in float32, scaled per column."""
    out = (x.float() @ weight.float().t()) * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(x.dtype)


@triton.jit
def _quantize_rows_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    mask = ks < K
    # The whole row in registers: one read of x (BLOCK_K >= K, see quantize_rows).
    x = tl.load(x_ptr + row * stride_xm + ks, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 0)
    scale = tl.maximum(tl.fdiv(amax, 448.0, ieee_rounding=True), 1e-12)
    tl.store(scale_ptr + row, scale)
    q = round_to_e4m3(tl.fdiv(x, scale, ieee_rounding=True))
    tl.store(q_ptr + row * K + ks, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (FP8 [M, K] contiguous, float32 scales [M, 1]) with
    `x ~ q * scale`, one scale per row: its absolute maximum over 448."""
    num_rows, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(num_rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(num_rows,)](
        x, q, scale, k, x.stride(0), BLOCK_K=block,
        num_warps=max(4, min(16, block // 1024)), **pdl_launch(x.device),
    )  # fmt: skip
    return q, scale


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of `quantize_rows`."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_fp8(x, scale), scale


@triton.jit
def _widen_kernel(w_ptr, out_ptr, numel, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):  # type: ignore[no-untyped-def]
    gdc_enter(USE_GDC)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask)


# Elements per program of `widen_fp8` (32 per thread at 4 warps: 32 bytes read, 64 written).
_WIDEN_BLOCK = 4096


def widen_fp8(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 (or int8) tensor widened exactly to `dtype` (bf16, fp16 or fp32 hold every e4m3
    value and every int8 code): `weight.to(dtype)`'s values. On the GPU a Triton kernel does
    it: torch's own conversion of FP8 ran at about a third of the copy bandwidth (bench notes,
    run 25)."""
    assert weight.dtype in fp8_gemv.WEIGHT_DTYPES and weight.is_contiguous()
    if weight.device.type != "cuda" and not interpreted():
        return weight.to(dtype)
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    numel = weight.numel()
    if numel:
        _widen_kernel[(triton.cdiv(numel, _WIDEN_BLOCK),)](
            weight, out, numel, BLOCK=_WIDEN_BLOCK, num_warps=4, **pdl_launch(weight.device)
        )  # fmt: skip
    return out


def dequantized_matmul(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:  # [M, N] in x's dtype
    """`(x @ W^T) * weight_scale + bias` through the library GEMM on W widened exactly to x's
    dtype (`widen_fp8`: a transient copy, twice the FP8 bytes): the GEMM's float32 sums rounded
    to x's dtype, scaled per channel in float32 and rounded again, then the bias added (rounded
    again)."""
    assert weight.dtype in fp8_gemv.WEIGHT_DTYPES and weight_scale.dtype == torch.float32
    out = torch.nn.functional.linear(x, widen_fp8(weight, x.dtype))
    out.mul_(weight_scale)
    if bias is not None:
        out.add_(bias)
    return out


def dequantized_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `dequantized_matmul` with its roundings made explicit (float32
    products; the CPU arithmetic of `quant/fp8_linear.Fp8Linear`)."""
    out = (x.float() @ weight.float().t()).to(x.dtype)
    out = (out.float() * weight_scale.float()).to(x.dtype)
    if bias is not None:
        out = (out.float() + bias.float()).to(x.dtype)
    return out
