"""Products with FP8 weights scaled per block: `y = x @ W^T (+ bias)` where
`W[n, k] = W_q[n, k] * s[n, k // group]`.

Block-wise FP8 checkpoints (docs/fp8.md, Weights) scale each `[rows, group]` block of a weight
on its own. The engine holds their scales per output row and group of `group` input columns,
`s` [N, ceil(K / group)] float32 (a block's scale repeated over its rows), so that any cut of
the rows (q/k/v stacked into one projection, column-parallel ranks) keeps its scales beside
it. The kernels take any strides of `s`; a prepared module stores it group-major (each group's
scales for all rows contiguous), so that a program's scales of one K step are one coalesced
load rather than one per row. The products multiply in float32 and apply a group's scale to
the sums over that group, so W's values are exactly the checkpoint's (an e4m3 code times its
block's scale) and the activations are not quantized:

- `block_weight_matmul`: at one or two rows (decode at small batch) a matrix-vector kernel:
  each program takes the per-channel one-row product's tile of W (8 rows x 512 columns, or
  4 x 1,024 where that gives too few programs; at least one group) and both activation rows;
  a K step's W (32 bytes per thread) is widened to float32, multiplied by each row, summed
  over each group, times the groups' scales. At more rows a matrix-unit tile (fp16 operands, as
  `kernels/fp8_linear.fp8_weight_matmul`: e4m3 widens to fp16 exactly, bf16 activations are
  rounded to fp16) with one product per group, scaled into a float32 accumulator. Its
  plain-torch twin is `block_weight_matmul_reference`.
- `block_gemv_silu_mul`: the matrix-vector kernel at an MLP's fused gate/up projection with
  `silu(gate) * up` applied in its epilogue.
- `widen_blocks`: W's values (`block_values`) in the activation dtype (a transient copy,
  rounded once: an e4m3 code times a float32 scale is not always a bf16 value) for the
  library's GEMM at many rows.
- `quantize_groups`: activations quantized per row and `group` columns (one scale per group,
  its absolute maximum over 448), the layout of the library's block-scaled FP8 GEMM
  (`torch.nn.functional.scaled_mm` with 1 x 128 and 128 x 128 scales,
  quant/fp8_block_linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from davit_engine.kernels import interpreted
from davit_engine.kernels.fp8 import round_to_e4m3, to_f16_saturated
from davit_engine.kernels.fp8_gemv import default_config, inverse_rms, store_add_norm
from davit_engine.kernels.layer_ops import silu_times
from davit_engine.kernels.pdl import gdc_enter, pdl_launch
from davit_engine.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

# Rows up to which `block_weight_matmul` runs the matrix-vector kernel.
GEMV_MAX_ROWS = 2
# The matrix-unit tile: rows and columns per program (K steps are one group).
TILE_SMALL_M = 16
TILE_LARGE_M = 64
TILE_N = 64
# Registers a thread of a one-row matrix-vector launch may take (None: the compiler's count).
# Compiled for sm_90, every one-row form takes 32 at the 4-warp tiles except the gated one with
# the norm's 1/rms, which took 40: 12 programs a multiprocessor instead of 16. At 32 its K loop
# is the plain form's and nothing spills, and on an H100 it took 44.6 us at gate/up against
# 49.8 uncapped (bench notes, run 37); the other forms compile to the same code either way.
# A CUDA compiler option: not passed under ROCm.
ONE_ROW_MAX_REGISTERS: int | None = 32


def kernel_group(group: int) -> bool:
    """Whether the Triton kernels take groups of `group` columns (one group per K step: a power
    of two from 16, the smallest matrix-unit K, to 256)."""
    return 16 <= group <= 256 and group & (group - 1) == 0


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int) -> None:
    n, k = weight.shape
    assert weight.dtype == FP8_DTYPE and weight.is_contiguous()
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1
    assert scale.dtype == torch.float32  # any strides (prepared modules store it group-major)
    assert tuple(scale.shape) == (n, triton.cdiv(k, group)), (tuple(scale.shape), n, k, group)
    assert kernel_group(group), group


def _gemv_tile(
    n_w: int, k: int, group: int, device: torch.device, two_rows: bool = False
) -> dict[str, int | bool]:
    """The matrix-vector kernel's launch arguments for W [n_w, k]: the per-channel one-row
    product's tile (`fp8_gemv.default_config`: 8 rows x 512 columns where that gives enough
    programs, else 4 x 1,024), a K step at least one group; at one row, capped at
    `ONE_ROW_MAX_REGISTERS`."""
    config = default_config(1, n_w, device)
    block_k = max(config.block_k, group)
    tile: dict[str, int | bool] = {
        "BLOCK_N": config.block_n,
        "BLOCK_K": block_k,
        "EVEN_K": k % block_k == 0,
        "TWO_ROWS": two_rows,
        "num_warps": config.num_warps,
    }
    if not two_rows and ONE_ROW_MAX_REGISTERS is not None and torch.version.hip is None:
        tile["maxnreg"] = ONE_ROW_MAX_REGISTERS
    return tile


@triton.jit
def _block_gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    G,
    stride_xm,
    stride_om,
    stride_sn,
    stride_sg,
    res_ptr,  # ADD_NORM: the residual stream [N], updated in place
    norm_w_ptr,  # ADD_NORM: the next RMSNorm's weight [N]
    squares_ptr,  # ADD_NORM: out, one sum of squares per program; NORMED: in, num_squares
    num_squares,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_GDC: tl.constexpr,
    GATED: tl.constexpr = False,
    ADD_NORM: tl.constexpr = False,
    NORMED: tl.constexpr = False,
    SQUARES_PAD: tl.constexpr = 1,
    TWO_ROWS: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)  # the launches' grid has one: 0
    # BLOCK_N rows of W. GATED: N output columns from 2N rows ([gate | up]), each column's gate
    # row and up row side by side, BLOCK_N // 2 columns a program.
    lanes = tl.arange(0, BLOCK_N)
    cols = pid_n * (BLOCK_N // 2) + lanes // 2 if GATED else pid_n * BLOCK_N + lanes
    # Columns past N read W's last row (the loads stay 16 bytes wide) and are never stored.
    w_row = tl.minimum(cols, N - 1).to(tl.int64)
    if GATED:
        w_row += (lanes % 2) * N
    # A K step is GROUPS groups of GROUP columns: W's [BLOCK_N, GROUPS, GROUP] tile (16 bytes a
    # thread a load, two a step), its products summed over each group, times the groups'
    # scales. (Keeping each thread's 16-column sums apart until after the loop, which drops the
    # shuffles from it, ran slower on an H100: bench notes, run 33.)
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    in_group = tl.arange(0, GROUP)
    step_groups = tl.arange(0, GROUPS)
    k_tile = step_groups[:, None] * GROUP + in_group[None, :]  # [GROUPS, GROUP]
    w_rows = w_ptr + w_row[:, None, None] * K  # [BLOCK_N, 1, 1]
    s_rows = s_ptr + w_row[:, None] * stride_sn  # [BLOCK_N, 1]
    # x's row 0 as a [BLOCK_N, GROUPS, GROUP]-shaped broadcast: read in W's layout (as
    # fp8_gemv's). TWO_ROWS: row 1 too, in the same program (W read once; not with the folds).
    x_row = x_ptr + row * stride_xm + (w_row * 0)[:, None, None]
    acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
    acc_2 = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)  # TWO_ROWS: row 1's
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k_tile[None, :, :]
        w = _load_k(w_rows + kk, kk, K, EVEN_K)
        x = _load_k(x_row + kk, kk, K, EVEN_K)
        part = tl.sum(w.to(tl.float32) * x.to(tl.float32), 2)  # [BLOCK_N, GROUPS]
        g = k0 // GROUP + step_groups[None, :]
        scale = tl.load(s_rows + g * stride_sg, mask=g < G, other=0.0)
        acc += part * scale
        if TWO_ROWS:
            x = _load_k(x_row + stride_xm + kk, kk, K, EVEN_K)
            acc_2 += tl.sum(w.to(tl.float32) * x.to(tl.float32), 2) * scale
    _store_block_row(tl.sum(acc, 1), row, pid_n, cols, w_row, N, K, stride_om,
                     bias_ptr, out_ptr, res_ptr, norm_w_ptr, squares_ptr, num_squares, eps,
                     HAS_BIAS, BLOCK_N, GATED, ADD_NORM, NORMED, SQUARES_PAD)  # fmt: skip
    if TWO_ROWS:
        _store_block_row(tl.sum(acc_2, 1), row + 1, pid_n, cols, w_row, N, K,
                         stride_om, bias_ptr, out_ptr, res_ptr, norm_w_ptr, squares_ptr,
                         num_squares, eps, HAS_BIAS, BLOCK_N, GATED, False, False,
                         SQUARES_PAD)  # fmt: skip


@triton.jit
def _load_k(ptrs, kk, K, EVEN_K: tl.constexpr):  # type: ignore[no-untyped-def]
    """A K step's values at `ptrs` (columns `kk`), zero past K unless the steps divide it."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=kk < K, other=0.0)


@triton.jit
def _store_block_row(  # type: ignore[no-untyped-def]
    acc, row, pid_n, cols, w_row, N, K, stride_om, bias_ptr, out_ptr, res_ptr, norm_w_ptr,
    squares_ptr, num_squares, eps, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    GATED: tl.constexpr, ADD_NORM: tl.constexpr, NORMED: tl.constexpr,
    SQUARES_PAD: tl.constexpr,
):  # fmt: skip
    """One activation row's sums `acc` [BLOCK_N] (W's rows `w_row`): the norm's 1/rms, the
    bias, then stored (the residual add and next norm's weight, or SiLU x up when gated)."""
    if NORMED:  # x is s * norm weight: the RMSNorm's 1/rms of s applies to the sums
        acc = acc * inverse_rms(squares_ptr, num_squares, K, eps, SQUARES_PAD)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_row).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if ADD_NORM:  # one row, no bias, not gated (block_gemv_add_norm)
        store_add_norm(acc[None, :], cols, pid_n, N, out_ptr, res_ptr, norm_w_ptr, squares_ptr)
    else:
        if GATED:  # silu(gate) * up, gate and up rounded to the activation dtype first
            gate, up = tl.split(tl.reshape(acc, [BLOCK_N // 2, 2]))
            acc = silu_times(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
            cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + row * stride_om + cols, acc.to(dtype), mask=cols < N)


@triton.jit
def _block_matmul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    N,
    K,
    G,
    stride_xm,
    stride_om,
    stride_sn,
    stride_sg,
    HAS_BIAS: tl.constexpr,
    F16_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
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
    ks = tl.arange(0, GROUP)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # W^T tile: [GROUP, BLOCK_N]
    s_cols = s_ptr + cols.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, G):
        kk = g * GROUP + ks
        k_valid = kk < K
        x = tl.load(x_rows + kk[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if F16_DOT:
            part = tl.dot(to_f16_saturated(x), w.to(tl.float16))
        else:
            part = tl.dot(x, w.to(tl.float32), input_precision=DOT_PRECISION)
        acc += part * tl.load(s_cols + g * stride_sg, mask=col_valid, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def block_weight_matmul(
    x: torch.Tensor,  # [M, K], rows contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor,  # [N, ceil(K / group)] float32
    group: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """`x @ W^T + bias`, W's values its codes times their groups' scales, summed in float32:
    the matrix-vector kernel up to `GEMV_MAX_ROWS` rows, else the matrix-unit tile."""
    _check(x, weight, scale, group)
    num_rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    groups = scale.shape[1]
    bias_arg = bias if bias is not None else scale
    if num_rows <= GEMV_MAX_ROWS:
        tile = _gemv_tile(n, k, group, x.device, two_rows=num_rows == 2)
        _block_gemv_kernel[(triton.cdiv(n, tile["BLOCK_N"]), 1)](
            x, weight, scale, bias_arg, out, n, k, groups, x.stride(0), out.stride(0),
            scale.stride(0), scale.stride(1), out, scale, scale, 0, 0.0,
            HAS_BIAS=bias is not None, GROUP=group, **tile,
            **pdl_launch(x.device),
        )  # fmt: skip
        return out
    block_m = TILE_SMALL_M if num_rows <= TILE_SMALL_M else TILE_LARGE_M
    grid = (triton.cdiv(n, TILE_N), triton.cdiv(num_rows, block_m))
    _block_matmul_kernel[grid](
        x, weight, scale, bias_arg, out, num_rows, n, k, groups, x.stride(0), out.stride(0),
        scale.stride(0), scale.stride(1), HAS_BIAS=bias is not None,
        F16_DOT=x.dtype != torch.float32, BLOCK_M=block_m, BLOCK_N=TILE_N, GROUP=group,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def block_gemv_silu_mul(
    x: torch.Tensor,  # [M, K], M <= GEMV_MAX_ROWS
    weight: torch.Tensor,  # [2N, K] float8_e4m3fn: an MLP's fused [gate | up]
    scale: torch.Tensor,  # [2N, ceil(K / group)] float32
    group: int,
    bias: torch.Tensor | None = None,  # [2N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """`silu(gate) * up` of `block_weight_matmul`'s output at one or two rows, in the
    matrix-vector kernel's epilogue: the numbers `layer_ops.silu_mul` gives on that output
    (gate and up rounded to x's dtype first), one kernel and no [M, 2N] intermediate."""
    _check(x, weight, scale, group)
    num_rows, k = x.shape
    assert num_rows <= GEMV_MAX_ROWS, num_rows
    n_w = weight.shape[0]
    if n_w % 2:
        raise ValueError(f"gated: the weight's rows are [gate | up], an even count (got {n_w})")
    n = n_w // 2
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    tile = _gemv_tile(n_w, k, group, x.device, two_rows=num_rows == 2)
    _block_gemv_kernel[(triton.cdiv(n_w, tile["BLOCK_N"]), 1)](
        x, weight, scale, bias if bias is not None else scale, out, n, k, scale.shape[1],
        x.stride(0), out.stride(0), scale.stride(0), scale.stride(1), out, scale, scale, 0, 0.0,
        HAS_BIAS=bias is not None, GROUP=group, GATED=True, **tile,
        **pdl_launch(x.device),
    )  # fmt: skip
    return out


def _check_one_row(name: str, x: torch.Tensor) -> None:
    if x.shape[0] != 1:
        raise ValueError(f"{name}: one row only (got {x.shape[0]})")


def block_gemv_add_norm(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, ceil(K / group)] float32
    group: int,
    residual: torch.Tensor,  # [1, N] in x's dtype, contiguous: updated in place
    norm_weight: torch.Tensor,  # [N], the RMSNorm after the add
) -> tuple[torch.Tensor, torch.Tensor]:  # ([1, N] s * norm weight, [programs] float32)
    """`fp8_gemv.fp8_gemv_add_norm` for block scales: `s = block_weight_matmul(x) + residual`
    (the product rounded to x's dtype, then the sum, as `add_rms_norm` rounds them), written
    into `residual`; returns `s * norm_weight` rounded and each program's sum of `s^2` over its
    columns, which `block_gemv_normed` and `fp8_gemv.fp8_gemv_normed` take."""
    _check(x, weight, scale, group)
    _check_one_row("block_gemv_add_norm", x)
    n, k = weight.shape
    assert residual.shape == (1, n) and residual.is_contiguous() and residual.dtype == x.dtype
    assert norm_weight.shape == (n,) and norm_weight.is_contiguous()
    tile = _gemv_tile(n, k, group, x.device)
    programs = triton.cdiv(n, tile["BLOCK_N"])
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    squares = torch.empty(programs, dtype=torch.float32, device=x.device)
    _block_gemv_kernel[(programs, 1)](
        x, weight, scale, scale, out, n, k, scale.shape[1], x.stride(0), out.stride(0),
        scale.stride(0), scale.stride(1), residual, norm_weight, squares, programs, 0.0,
        HAS_BIAS=False, GROUP=group, ADD_NORM=True, **tile, **pdl_launch(x.device),
    )  # fmt: skip
    return out, squares


def block_gemv_normed(
    x: torch.Tensor,  # [1, K]: s * norm weight, from a producer's add_norm
    squares: torch.Tensor,  # the producer's sums of squares of s
    eps: float,  # the RMSNorm's
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, ceil(K / group)] float32
    group: int,
    bias: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:  # [1, N] ([1, N / 2] gated)
    """`fp8_gemv.fp8_gemv_normed` for block scales: the product of `RMSNorm(s)` from
    `s * norm weight`, the sums times `rsqrt(sum(squares) / K + eps)` (then the bias, and
    SiLU x up when `gated`)."""
    _check(x, weight, scale, group)
    _check_one_row("block_gemv_normed", x)
    n_w, k = weight.shape
    assert squares.dtype == torch.float32 and squares.dim() == 1 and squares.is_contiguous()
    if gated and n_w % 2:
        raise ValueError(f"gated: the weight's rows are [gate | up], an even count (got {n_w})")
    n = n_w // 2 if gated else n_w
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    num_squares = squares.shape[0]
    tile = _gemv_tile(n_w, k, group, x.device)
    _block_gemv_kernel[(triton.cdiv(n_w, tile["BLOCK_N"]), 1)](
        x, weight, scale, bias if bias is not None else scale, out, n, k, scale.shape[1],
        x.stride(0), out.stride(0), scale.stride(0), scale.stride(1),
        out, scale, squares, num_squares, eps,
        HAS_BIAS=bias is not None, GROUP=group, GATED=gated, NORMED=True,
        SQUARES_PAD=triton.next_power_of_2(num_squares), **tile, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def block_values(weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """W's values in float32: each code times its group's scale (exact)."""
    k = weight.shape[1]
    return weight.float() * scale.repeat_interleave(group, dim=1)[:, :k]


def block_weight_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `block_weight_matmul`: float32 products, rounded once."""
    out = x.float() @ block_values(weight, scale, group).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit
def _widen_blocks_kernel(  # type: ignore[no-untyped-def]
    w_ptr, s_ptr, out_ptr, K, stride_sn, stride_sg, BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    valid = ks < K
    w = tl.load(w_ptr + row * K + ks, mask=valid, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + row * stride_sn + (ks // GROUP) * stride_sg, mask=valid, other=0.0)
    tl.store(out_ptr + row * K + ks, (w * s).to(out_ptr.dtype.element_ty), mask=valid)


_WIDEN_BLOCK_K = 1024


def widen_blocks(
    weight: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """W's values (`block_values`) rounded once to `dtype`, a new [N, K] tensor."""
    n, k = weight.shape
    assert weight.dtype == FP8_DTYPE and weight.is_contiguous()
    if weight.device.type != "cuda" and not interpreted():
        return block_values(weight, scale, group).to(dtype)
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    if out.numel():
        _widen_blocks_kernel[(n, triton.cdiv(k, _WIDEN_BLOCK_K))](
            weight, scale, out, k, scale.stride(0), scale.stride(1), BLOCK_K=_WIDEN_BLOCK_K,
            GROUP=group,
            num_warps=4, **pdl_launch(weight.device),
        )  # fmt: skip
    return out


@triton.jit
def _quantize_groups_kernel(  # type: ignore[no-untyped-def]
    x_ptr, q_ptr, s_ptr, G, stride_xm, stride_sm, stride_sg,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """One row's `GROUPS` groups of `GROUP` columns: each group's scale (its absolute maximum
    over 448, at least 1e-12), its values divided by it and rounded to e4m3."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    valid = groups < G
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + row * stride_xm + cols, mask=valid[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.maximum(tl.fdiv(amax, 448.0, ieee_rounding=True), 1e-12)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=valid)
    q = round_to_e4m3(tl.fdiv(x, scale[:, None], ieee_rounding=True))
    tl.store(q_ptr + row * (G * GROUP) + cols, q.to(q_ptr.dtype.element_ty), mask=valid[:, None])


# Values per program of `quantize_groups`' kernel (2 KB of bf16 activations).
_QUANTIZE_VALUES = 1024


def quantize_groups(
    x: torch.Tensor, group: int, rows_minor: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of `group`, rows contiguous) -> (FP8 codes [M, K], float32
    scales [M, K / group]) with `x ~ q * scale` per row and group: the group's absolute
    maximum over 448 (at least `MIN_SCALE`), the value divided by it in float32 and rounded to
    nearest e4m3. `rows_minor`: the scales stored with M contiguous (a transposed view), the
    layout the library's block-scaled GEMM takes. On the GPU one Triton kernel reads x once;
    on the CPU plain torch computes the same numbers."""
    m, k = x.shape
    assert k % group == 0, (k, group)
    groups = k // group
    if x.device.type != "cuda" and not interpreted():
        values = x.float().view(m, groups, group)
        scale = (values.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
        codes = (values / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return codes.view(m, k), (scale.t().contiguous().t() if rows_minor else scale)
    assert x.stride(1) == 1 and kernel_group(group), (x.stride(), group)
    codes = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = (
        torch.empty(groups, m, dtype=torch.float32, device=x.device).t()
        if rows_minor
        else torch.empty(m, groups, dtype=torch.float32, device=x.device)
    )
    if m and groups:
        per_program = max(1, min(_QUANTIZE_VALUES // group, triton.next_power_of_2(groups)))
        _quantize_groups_kernel[(m, triton.cdiv(groups, per_program))](
            x, codes, scale, groups, x.stride(0), scale.stride(0), scale.stride(1),
            GROUP=group, GROUPS=per_program, num_warps=4, **pdl_launch(x.device),
        )  # fmt: skip
    return codes, scale
