"""FP8-weight products at a few rows (decode): `y = (x @ W_fp8^T) * w_scale (+ bias)` as a
matrix-vector product that streams W once at memory bandwidth. W may also hold int8 codes with
the same per-row scales (an int8 LM head), widened exactly by packed integer and fp16
instructions (`widen`).

At one to a few activation rows the product reads every weight once and does two operations
per weight byte, so its floor is W's bytes over memory bandwidth. A matrix-unit tile would be
at least 16 rows tall (15 of them padding at one row) and needs W's tile reshaped through
shared memory; this kernel instead gives each program a [BLOCK_N, BLOCK_K] tile of W per step,
loaded 16 bytes per thread, widens it to float32 with the hardware conversion (sm_89+: a pair
of e4m3 values to an fp16 pair in one instruction, fp16 to fp32 on the arithmetic pipe) and
multiplies it by the broadcast activation rows on the float32 units, accumulating element-wise
in a [ROWS, BLOCK_N, BLOCK_K] float32 tile that is summed over K once, after the loop: one
multiply-add per weight and row. A program takes up to `ROWS_PER_PROGRAM` rows; more rows
re-read W once per group. When the columns alone give too few programs to fill the GPU
(o_proj and down_proj at 4096 outputs), K is split over `split_k` programs whose float32
partial sums a second kernel adds, scales and casts in a fixed order (deterministic).

`w_scale` and the bias apply once per output. Activations are read in their own dtype (bf16,
fp16 or fp32) and widened to float32, so the only rounding besides float32 summation is the
final cast.

At one row the tiles of W can instead be streamed by the tensor memory accelerator
(`GemvConfig.stages`, sm_90+, off by default: `STREAM_STAGES`): `stages - 1` tiles of W per
program are in flight in shared memory while the program multiplies the one before, where the
plain loads keep one tile per program in flight, and a program may fetch its first tile of W
before it waits for the kernel before it (`GemvConfig.preload`): W does not depend on that
kernel, so under programmatic dependent launch the fetch overlaps its tail. Same products in
the same order as the plain kernel.

An MLP's fused gate/up projection can apply its activation in the epilogue (`gated=True`):
each program's tile pairs every gate row with its up row, so it holds both sums of an output
and writes `silu(gate) * up` ([rows, N / 2]) instead of the product: at decode that removes
the SiLU kernel and the product's round trip through memory, at the same bytes of W per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from davit_engine.kernels import capability, interpreted, multiprocessors
from davit_engine.kernels.layer_ops import silu_times
from davit_engine.kernels.pdl import gdc_enter, pdl_launch
from davit_engine.layers.fp8 import FP8_DTYPE

try:  # host-side tensor descriptors (Triton 3.3+); without them W is never streamed
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None


@dataclass(frozen=True)
class GemvConfig:
    """Tile and launch options of `fp8_gemv`. `split_k` 0: chosen from the shape and the GPU's
    multiprocessor count (`default_split_k`). `stages` >= 2: at one row, W's tiles streamed by
    the tensor memory accelerator through that many pipeline stages (`stages - 1` tiles in
    flight; where it cannot run, the plain loads); `preload` 1: at one row, the first tile of
    W fetched before the wait for the previous kernel (streamed, or with the plain loads where
    K is a whole number of steps)."""

    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 0
    stages: int = 0
    preload: int = 0
    unroll: int = 1

    @property
    def label(self) -> str:
        split = f"s{self.split_k}" if self.split_k else "sauto"
        stream = f"t{self.stages}" if self.stages else ""
        preload = "p" if self.preload else ""
        unroll = f"u{self.unroll}" if self.unroll > 1 else ""
        return (
            f"gemv_{self.block_n}x{self.block_k}w{self.num_warps}{split}{stream}{preload}{unroll}"
        )


# One row: 8 x 512 bytes of W per program and step (32 bytes per thread of 4 warps), about
# 65 registers, so several programs share a multiprocessor; at few output columns (o_proj and
# down_proj at 4096) the same bytes as 4 x 1024, which gives twice the programs without a
# second pass over split-K partial sums. Several rows: a narrower tile keeps the
# [ROWS, BLOCK_N, BLOCK_K] accumulator (ROWS * 16 floats per thread) in registers.
ONE_ROW_CONFIG = GemvConfig(block_n=8, block_k=512, num_warps=4)
ONE_ROW_NARROW_CONFIG = GemvConfig(block_n=4, block_k=1024, num_warps=4)
FEW_ROWS_CONFIG = GemvConfig(block_n=4, block_k=512, num_warps=4)
# Rows up to which `fp8_weight_matmul` uses this kernel (beyond: the matrix-unit kernel). On
# the H200 (bench notes run 11) it was 1.8-2.0x faster than the matrix-unit kernel at one row
# and 8% slower in sum over W2's four shapes at four rows; 2 and 3 rows were not measured.
MAX_ROWS = 2
ROWS_PER_PROGRAM = 4
# Programs per multiprocessor that `default_split_k` aims for.
_PROGRAMS_PER_SM = 4
# The one-row default's streaming (`GemvConfig.stages` and `preload`): off. On an H100 (bench
# notes, run 24) W2 with FP8 weights and KV ran slower with it, 251.8-257.4 decode tok/s at 3
# or 4 stages with or without the preload against 270.3 without (medians of three), and the
# products alone were level at qkv and gate/up and slower at o and down (down 28.1 us at 4
# stages against 22.4). Switches for the bench's variants.
STREAM_STAGES = 0
STREAM_PRELOAD = 0
# Without streaming, the one-row default's first tile of W loaded into registers before the
# wait for the kernel before (`GemvConfig.preload`; 32 bytes per thread held across the wait):
# under programmatic dependent launch a product's programs become resident while the kernel
# before runs, so that load overlaps its tail instead of starting after it. Off: on an H100
# (bench notes, run 25) W2 with FP8 weights and KV ran 4.1% slower with it (261.9 decode
# tok/s against 273.0, medians of two; 266.4 against 279.1 with the early loads of attention
# and rotary), though the one-row qkv product alone was 1.6% faster (11.12 us against 11.30).
# A switch for the bench's variants.
PLAIN_PRELOAD = 0
# The one-row default's plain loads two K steps a round (`GemvConfig.unroll`) where its tile is
# 8 x 512 (`UNROLL_NARROW` off: not at the narrow 4 x 1,024 tile). On an H100 (bench notes,
# run 34) W2 with FP8 weights and KV ran at 292.5 decode tok/s with it against 287.7 without
# (+1.7%, medians of three, the same 256 tokens); alone, qkv took 10.66 us against 11.33 and
# gate/up 41.30 against 42.52, while at the narrow tile o took 8.51 against 8.26 and down
# 23.40 against 22.32, and W2 with both tiles unrolled ran at 281.0. (Run 27's form, uncapped,
# had been level: ptxas issued its second step's loads after the first step's multiply-adds.)
# 1 turns it off (bench variant `fp8-both-unroll1`).
PLAIN_UNROLL = 2
# Registers a program may take at two K steps a round. Uncapped, ptxas (sm_90, Triton 3.6 and
# 3.9) gives the kernel about 70 and issues the second step's loads after the first step's
# multiply-adds, so no more bytes are in flight than at one step; at 80 it issues both steps'
# loads first (6 programs a multiprocessor: 48 KB of W in flight against 8 x 4 KB).
UNROLL_MAX_REGISTERS = 80
# Whether `PLAIN_UNROLL` also applies where the default tile is the narrow 4 x 1,024 one (o and
# down at Llama-3.1-8B's shapes): off (above).
UNROLL_NARROW = False


# W's code types: e4m3 (the projections, and an FP8 LM head) and int8 (an int8 LM head:
# `--lm-head-quantization int8`, one float32 scale per row as FP8's).
WEIGHT_DTYPES = (FP8_DTYPE, torch.int8)
# int8 W widened on a GPU with `_INT8_TO_F16` (packed integer and half-precision instructions)
# rather than the compiler's per-element conversion. A switch for the bench's variants.
INT8_WIDEN_PRMT = True


def int8_prmt(weight: torch.Tensor) -> bool:
    """Whether the product widens `weight`'s codes with `_INT8_TO_F16`: int8 codes on an NVIDIA
    GPU (the assembly is PTX: not under ROCm, and the interpreter runs none), where
    `INT8_WIDEN_PRMT` is on."""
    return (
        INT8_WIDEN_PRMT
        and weight.dtype == torch.int8
        and weight.device.type == "cuda"
        and torch.version.hip is None
        and not interpreted()
    )


def default_config(num_rows: int, n: int, device: torch.device) -> GemvConfig:
    if num_rows > 1:
        return FEW_ROWS_CONFIG
    wanted = _PROGRAMS_PER_SM * multiprocessors(device)
    wide = triton.cdiv(n, ONE_ROW_CONFIG.block_n) >= wanted
    config = ONE_ROW_CONFIG if wide else ONE_ROW_NARROW_CONFIG
    if STREAM_STAGES:
        return dataclasses.replace(config, stages=STREAM_STAGES, preload=STREAM_PRELOAD)
    if PLAIN_PRELOAD:
        config = dataclasses.replace(config, preload=1)
    if PLAIN_UNROLL > 1 and (wide or UNROLL_NARROW):
        config = dataclasses.replace(config, unroll=PLAIN_UNROLL)
    return config


def can_stream(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> bool:
    """Whether `config` streams W here: asked for (`stages` >= 2), one row, the tensor memory
    accelerator's alignment (W's base and rows on 16 bytes) and a GPU that has one (sm_90+;
    or Triton's interpreter, which runs the same kernel on the CPU)."""
    if TensorDescriptor is None or config.stages < 2 or x.shape[0] != 1:
        return False
    if weight.dtype != FP8_DTYPE:
        return False
    if weight.shape[1] % 16 or weight.data_ptr() % 16:
        return False
    if x.device.type == "cuda":
        return not interpreted() and capability(x.device) >= (9, 0)
    return interpreted()


def default_split_k(n: int, k: int, config: GemvConfig, device: torch.device) -> int:
    """Smallest power-of-two split of K giving about `_PROGRAMS_PER_SM` programs per
    multiprocessor, keeping at least two K steps per split."""
    programs = triton.cdiv(n, config.block_n)
    wanted = _PROGRAMS_PER_SM * multiprocessors(device)
    steps = triton.cdiv(k, config.block_k)
    split = 1
    while programs * split < wanted and steps // (split * 2) >= 2:
        split *= 2
    return split


# int8 codes to fp16, four a 32-bit register (`widen`): each byte's sign bit flipped gives
# `code + 128` unsigned; placed under the high byte 0x64 it is the fp16 `1024 + code + 128`
# (fp16 has unit spacing on [1024, 2048)), and one packed subtraction of 1152 leaves the
# code, exact. Five instructions for four weights on the integer and half-precision pipes,
# where the compiler's per-element integer-to-float conversion runs at a quarter of the
# float32 rate.
_INT8_TO_F16 = tl.constexpr(
    """
{
.reg .b32 t, hi, bias;
xor.b32 t, $2, 0x80808080;
mov.b32 hi, 0x64646464;
prmt.b32 $0, t, hi, 0x5150;
prmt.b32 $1, t, hi, 0x5352;
mov.b32 bias, 0x64806480;
sub.f16x2 $0, $0, bias;
sub.f16x2 $1, $1, bias;
}
"""
)


@triton.jit
def widen(w, INT8_PRMT: tl.constexpr):  # type: ignore[no-untyped-def]
    """A tile of W's codes as float32: e4m3 through the hardware conversion, int8 (an int8 LM
    head) with `_INT8_TO_F16` where `INT8_PRMT` (a GPU), else the plain conversion."""
    if INT8_PRMT:
        half = tl.inline_asm_elementwise(
            _INT8_TO_F16, "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4
        )
        return half.to(tl.float32)
    else:
        return w.to(tl.float32)


@triton.jit
def _fp8_gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    num_rows,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,
    res_ptr,  # ADD_NORM: the residual stream [N], updated in place
    norm_w_ptr,  # ADD_NORM: the next RMSNorm's weight [N]
    squares_ptr,  # ADD_NORM: out, one sum of squares per program; NORMED: in, num_squares
    num_squares,
    eps,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    PRELOAD: tl.constexpr,
    USE_GDC: tl.constexpr,
    ADD_NORM: tl.constexpr = False,
    NORMED: tl.constexpr = False,
    SQUARES_PAD: tl.constexpr = 1,
    UNROLL: tl.constexpr = 1,  # one row, EVEN_K: 2 = two steps' loads a round
    INT8_PRMT: tl.constexpr = False,  # int8 W widened with `_INT8_TO_F16` (a GPU)
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    # The tile's BLOCK_N rows of W. GATED: N output columns from 2N rows of W ([gate | up]),
    # each column's gate row and up row side by side in the tile, BLOCK_N // 2 columns.
    lanes = tl.arange(0, BLOCK_N)
    cols = pid_n * (BLOCK_N // 2) + lanes // 2 if GATED else pid_n * BLOCK_N + lanes
    # Out-of-range columns read the last row of W (no mask: the loads stay 16 bytes wide) and
    # are never stored.
    w_row = tl.minimum(cols, N - 1)
    if GATED:
        w_row += (lanes % 2) * N
    w_rows = w_ptr + w_row.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    ks = tl.arange(0, BLOCK_K)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if PRELOAD:  # one row, EVEN_K: the first tile of W before the wait (W is no output of the
        # kernel before); a split past K's end reads the last tile and adds nothing
        w_first = tl.load(w_rows + (tl.minimum(k_begin, K - BLOCK_K) + ks)[None, :])
    gdc_enter(USE_GDC)
    # x rows as a [.., BLOCK_N, BLOCK_K]-shaped broadcast: the compiler then reads each
    # activation once per thread in the W tile's own layout (no shuffle through shared memory
    # per step). Rows past num_rows read the last row and are never stored.
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    x_rows = x_ptr + (tl.minimum(rows, num_rows - 1).to(tl.int64) * stride_xm)[:, None, None]
    x_rows = x_rows + (cols * 0)[None, :, None]  # [ROWS, BLOCK_N, 1]
    # Products accumulate element-wise and are summed over K once, after the loop: one
    # multiply-add per weight and row. (W is not prefetched into registers across steps: a
    # loop-carried FP8 tile is kept as single bytes and repacked, which costs more than the
    # overlap gains; other programs on the multiprocessor keep loads in flight.)
    if ROWS == 1:  # 2-D: the compiler keeps x in W's layout (the 3-D form goes through smem)
        x_row = x_ptr + (pid_m.to(tl.int64) * stride_xm + cols * 0)[:, None]  # [BLOCK_N, 1]
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        k_loop = k_begin
        if PRELOAD:
            if k_begin < k_end:
                x = tl.load(x_row + (k_begin + ks)[None, :])
                acc2 += widen(w_first, INT8_PRMT) * x.to(tl.float32)
            k_loop += BLOCK_K
        # UNROLL 2: pairs of steps, then the odd step left, if any, in a block of its own (run
        # through the one-step loop below instead, ptxas at 80 registers issued only 6 of a
        # pair's 8 loads before its first multiply-add)
        if UNROLL == 2 and EVEN_K:
            for k0 in range(k_loop, k_end - BLOCK_K, 2 * BLOCK_K):
                kk = k0 + ks
                w = tl.load(w_rows + kk[None, :])
                w_next = tl.load(w_rows + (kk + BLOCK_K)[None, :])
                x = tl.load(x_row + kk[None, :])
                x_next = tl.load(x_row + (kk + BLOCK_K)[None, :])
                acc2 += widen(w, INT8_PRMT) * x.to(tl.float32)
                acc2 += widen(w_next, INT8_PRMT) * x_next.to(tl.float32)
            steps = (k_end - k_loop) // BLOCK_K
            if steps > 0 and steps % 2 == 1:
                kk = k_end - BLOCK_K + ks
                w = tl.load(w_rows + kk[None, :])
                x = tl.load(x_row + kk[None, :])
                acc2 += widen(w, INT8_PRMT) * x.to(tl.float32)
        else:
            for k0 in range(k_loop, k_end, BLOCK_K):
                kk = k0 + ks
                if EVEN_K:
                    w = tl.load(w_rows + kk[None, :])
                    x = tl.load(x_row + kk[None, :])
                else:
                    w = tl.load(w_rows + kk[None, :], mask=kk[None, :] < k_end, other=0.0)
                    x = tl.load(x_row + kk[None, :], mask=kk[None, :] < k_end, other=0.0)
                acc2 += widen(w, INT8_PRMT) * x.to(tl.float32)
        total = tl.sum(acc2, 1)[None, :]  # [1, BLOCK_N]
        if NORMED:  # x is s * norm weight: the RMSNorm's 1/rms of s applies to the sums
            total = total * inverse_rms(squares_ptr, num_squares, K, eps, SQUARES_PAD)
    else:
        acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + ks
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :])
                x = tl.load(x_rows + kk[None, None, :])
            else:
                w = tl.load(w_rows + kk[None, :], mask=kk[None, :] < k_end, other=0.0)
                x = tl.load(x_rows + kk[None, None, :], mask=kk[None, None, :] < k_end, other=0.0)
            acc += widen(w, INT8_PRMT)[None, :, :] * x.to(tl.float32)
        total = tl.sum(acc, 2)  # [ROWS, BLOCK_N]
    if ADD_NORM:  # one row, one split, no bias, not gated (fp8_gemv_add_norm)
        _store_add_norm(total, cols, w_row, pid_n, N, scale_ptr, out_ptr, res_ptr, norm_w_ptr,
                        squares_ptr)  # fmt: skip
    else:
        _store_rows(total, rows, cols, w_row, pid_n, split, num_rows, N, scale_ptr, bias_ptr,
                    out_ptr, part_ptr, stride_om, HAS_BIAS, ROWS, BLOCK_N, SPLIT_K, GATED)  # fmt: skip


@triton.jit
def inverse_rms(  # type: ignore[no-untyped-def]
    squares_ptr, num_squares, K, eps, SQUARES_PAD: tl.constexpr
):  # fmt: skip
    """The RMSNorm's `1 / rms` of s from the sums of squares of s [num_squares] the producer's
    programs wrote (`store_add_norm`), K the norm's width."""
    parts = tl.arange(0, SQUARES_PAD)
    squares = tl.load(squares_ptr + parts, mask=parts < num_squares, other=0.0)
    return tl.rsqrt(tl.sum(squares, 0) / K + eps)


@triton.jit
def _store_add_norm(  # type: ignore[no-untyped-def]
    total, cols, w_row, pid_n, N, scale_ptr, out_ptr, res_ptr, norm_w_ptr, squares_ptr
):  # fmt: skip
    """`store_add_norm` of one row's product `total` [1, BLOCK_N] times its channel scales."""
    product = total * tl.load(scale_ptr + w_row)[None, :]
    store_add_norm(product, cols, pid_n, N, out_ptr, res_ptr, norm_w_ptr, squares_ptr)


@triton.jit
def store_add_norm(  # type: ignore[no-untyped-def]
    product, cols, pid_n, N, out_ptr, res_ptr, norm_w_ptr, squares_ptr
):  # fmt: skip
    """One row's scaled product `product` [1, BLOCK_N] float32 (columns `cols`), rounded to the
    activation dtype and added to the residual stream as `layer_ops.add_rms_norm` adds it (the
    sum `s` rounded, written back in place); out: `s * norm weight` rounded, and the program's
    sum of `s^2` over its columns (at `squares_ptr + pid_n`)."""
    valid = (cols < N)[None, :]
    dtype = out_ptr.dtype.element_ty
    product = product.to(dtype).to(tl.float32)
    dst = cols[None, :]
    residual = tl.load(res_ptr + dst, mask=valid, other=0.0).to(tl.float32)
    s = (product + residual).to(dtype)
    tl.store(res_ptr + dst, s, mask=valid)
    s32 = tl.where(valid, s.to(tl.float32), 0.0)
    norm_w = tl.load(norm_w_ptr + dst, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, (s32 * norm_w).to(dtype), mask=valid)
    tl.store(squares_ptr + pid_n, tl.sum(tl.sum(s32 * s32, 1), 0))


@triton.jit
def _store_rows(  # type: ignore[no-untyped-def]
    total, rows, cols, w_row, pid_n, split, num_rows, N, scale_ptr, bias_ptr, out_ptr, part_ptr,
    stride_om, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """A program's sums over its K range, `total` [ROWS, BLOCK_N] for W's rows `w_row` (GATED:
    gate and up rows alternating, output columns `cols`): scaled, biased (and SiLU x up) into
    the output, or stored as split-K partial sums."""
    store_mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    if SPLIT_K == 1:
        out = total * tl.load(scale_ptr + w_row)[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + w_row).to(tl.float32)[None, :]
        if GATED:  # [ROWS, BLOCK_N] -> gate and up [ROWS, BLOCK_N // 2]
            gate, up = tl.split(tl.reshape(out, [ROWS, BLOCK_N // 2, 2]))
            dtype = out_ptr.dtype.element_ty
            out = silu_times(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
            cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            store_mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
        dst = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:  # partial sums [SPLIT_K, num_rows, rows of W]: _sum_splits_kernel finishes them
        n_w = 2 * N if GATED else N
        dst = part_ptr + (split * num_rows + rows.to(tl.int64))[:, None] * n_w + w_row[None, :]
        tl.store(dst, total, mask=store_mask)


@triton.jit
def _fp8_gemv_stream_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_desc,  # W [N (GATED: 2N), K] in tiles of [TILE, BLOCK_K] rows
    scale_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    N,
    K,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    STAGES: tl.constexpr,
    PRELOAD: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """`_fp8_gemv_kernel` at one row with W's tiles streamed through shared memory by the
    tensor memory accelerator (`STAGES - 1` in flight); GATED: a gate tile and its up tile per
    step ([BLOCK_N // 2, BLOCK_K] each). Rows past W's end read as zeros."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    TILE: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    first = pid_n * TILE
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if PRELOAD:  # before the wait: W is no output of the kernel before
        w_pre = w_desc.load([first, k_begin])
        if GATED:
            u_pre = w_desc.load([N + first, k_begin])
    gdc_enter(USE_GDC)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([TILE, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([TILE, BLOCK_K], dtype=tl.float32)
    k_loop = k_begin
    if PRELOAD:
        x_pre = tl.load(x_ptr + k_begin + ks, mask=k_begin + ks < k_end, other=0.0)
        acc += w_pre.to(tl.float32) * x_pre.to(tl.float32)[None, :]
        if GATED:
            acc_up += u_pre.to(tl.float32) * x_pre.to(tl.float32)[None, :]
        k_loop += BLOCK_K
    for k0 in tl.range(k_loop, k_end, BLOCK_K, num_stages=STAGES):
        kk = k0 + ks
        if EVEN_K:
            x = tl.load(x_ptr + kk).to(tl.float32)[None, :]
        else:
            x = tl.load(x_ptr + kk, mask=kk < k_end, other=0.0).to(tl.float32)[None, :]
        acc += w_desc.load([first, k0]).to(tl.float32) * x
        if GATED:
            acc_up += w_desc.load([N + first, k0]).to(tl.float32) * x
    lanes = tl.arange(0, BLOCK_N)
    if GATED:  # gate and up sums alternating, as _fp8_gemv_kernel's tile holds them
        total = tl.reshape(tl.join(tl.sum(acc, 1), tl.sum(acc_up, 1)), [BLOCK_N])[None, :]
        cols = first + lanes // 2
        w_row = tl.minimum(cols, N - 1) + (lanes % 2) * N
    else:
        total = tl.sum(acc, 1)[None, :]
        cols = first + lanes
        w_row = tl.minimum(cols, N - 1)
    rows = tl.arange(0, 1)
    _store_rows(total, rows, cols, w_row, pid_n, split, 1, N, scale_ptr, bias_ptr, out_ptr,
                part_ptr, 0, HAS_BIAS, 1, BLOCK_N, SPLIT_K, GATED)  # fmt: skip


@triton.jit
def _sum_splits_kernel(  # type: ignore[no-untyped-def]
    part_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < N
    out = _finish_splits(part_ptr, scale_ptr, bias_ptr, num_rows, 2 * N if GATED else N, row,
                         cols, valid, HAS_BIAS, SPLIT_K)  # fmt: skip
    if GATED:  # the up rows follow the gate rows
        up = _finish_splits(part_ptr, scale_ptr, bias_ptr, num_rows, 2 * N, row, cols + N,
                            valid, HAS_BIAS, SPLIT_K)  # fmt: skip
        dtype = out_ptr.dtype.element_ty
        out = silu_times(out.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    tl.store(out_ptr + row * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _finish_splits(  # type: ignore[no-untyped-def]
    part_ptr, scale_ptr, bias_ptr, num_rows, n_w, row, w_rows, valid,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Rows `w_rows` of W's partial sums added over the splits in a fixed order, scaled (and
    biased), in float32."""
    splits = tl.arange(0, SPLIT_K)
    parts = tl.load(part_ptr + (splits[:, None] * num_rows + row) * n_w + w_rows[None, :],
                    mask=valid[None, :], other=0.0)  # fmt: skip
    out = tl.sum(parts, 0) * tl.load(scale_ptr + w_rows, mask=valid, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + w_rows, mask=valid, other=0.0).to(tl.float32)
    return out


def fp8_gemv(
    x: torch.Tensor,  # [M, K], rows contiguous, M small (see MAX_ROWS)
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig | None = None,
    gated: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype ([M, N / 2] when gated)
    """`(x @ weight^T) * weight_scale + bias` with float32 accumulation, any number of rows
    (made for one to `MAX_ROWS`; W is read once per `ROWS_PER_PROGRAM` rows).

    `gated`: W is an MLP's fused `[gate | up]` projection and the result is
    `silu(gate) * up` [M, N / 2], the numbers `layer_ops.silu_mul` gives on the product's
    output (gate and up rounded to x's dtype first), without writing the product or launching
    a second kernel. Each program then takes a gate row and its up row side by side, the same
    bytes per step as the plain product."""
    num_rows, k = x.shape
    n_w = weight.shape[0]
    assert weight.dtype in WEIGHT_DTYPES and weight.is_contiguous() and weight.shape[1] == k
    assert x.stride(1) == 1 and weight_scale.dtype == torch.float32
    if gated and n_w % 2:
        raise ValueError(f"gated: the weight's rows are [gate | up], an even count (got {n_w})")
    n = n_w // 2 if gated else n_w
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    cfg = config or default_config(num_rows, n_w, x.device)
    if gated and cfg.block_n < 2:
        raise ValueError(f"gated: config.block_n must be at least 2 (got {cfg.block_n})")
    rows_per_program = min(triton.next_power_of_2(num_rows), ROWS_PER_PROGRAM)
    split_k = cfg.split_k or default_split_k(n_w, k, cfg, x.device)
    split_k = triton.next_power_of_2(max(1, min(split_k, triton.cdiv(k, cfg.block_k))))
    # whole K steps per split, so that only the last split can end inside a step
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), cfg.block_k) * cfg.block_k
    part = (
        torch.empty(split_k, num_rows, n_w, dtype=torch.float32, device=x.device)
        if split_k > 1
        else out
    )
    launch = pdl_launch(x.device)
    grid = (triton.cdiv(n_w, cfg.block_n), split_k, triton.cdiv(num_rows, rows_per_program))
    if can_stream(x, weight, cfg):
        tile = [cfg.block_n // 2 if gated else cfg.block_n, cfg.block_k]
        _fp8_gemv_stream_kernel[grid](
            x, TensorDescriptor(weight, [n_w, k], [k, 1], tile), weight_scale,
            bias if bias is not None else weight_scale, out, part, n, k, k_per_split,
            HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            SPLIT_K=split_k, EVEN_K=k % cfg.block_k == 0, GATED=gated, STAGES=cfg.stages,
            PRELOAD=min(cfg.preload, 1), num_warps=cfg.num_warps, num_stages=cfg.stages,
            **launch,
        )  # fmt: skip
    else:
        _fp8_gemv_kernel[grid](
            x, weight, weight_scale, bias if bias is not None else weight_scale, out, part,
            num_rows, n, k, x.stride(0), out.stride(0), k_per_split,
            out, weight_scale, weight_scale, 0, 0.0,
            HAS_BIAS=bias is not None, ROWS=rows_per_program, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, SPLIT_K=split_k, EVEN_K=k % cfg.block_k == 0, GATED=gated,
            PRELOAD=bool(cfg.preload) and rows_per_program == 1 and k % cfg.block_k == 0,
            INT8_PRMT=int8_prmt(weight),
            **(_unroll(cfg) if rows_per_program == 1 else {}),
            num_warps=cfg.num_warps, num_stages=1, **launch,
        )  # fmt: skip
    if split_k > 1:
        block = 512
        _sum_splits_kernel[(triton.cdiv(n, block), num_rows)](
            part, weight_scale, bias if bias is not None else weight_scale, out,
            num_rows, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=block, GATED=gated, num_warps=4,
            **launch,
        )  # fmt: skip
    return out


# ---- one-row products with the residual add and RMSNorm folded in ----------------------------
#
# At one token a decoder layer's `add_rms_norm` kernels (after attention and after the MLP) each
# sit between two products. `fp8_gemv_add_norm` (o, down) does the add in its epilogue and
# applies the next norm's weight; `fp8_gemv_normed` (q/k/v, gate/up) applies the norm's 1/rms,
# a single number, to its sums after the K loop, from the sums of squares the producer's
# programs wrote. The numbers differ from the unfused kernels' only in where one rounding
# happens: the product's input is `s * norm weight` rounded to the activation dtype, where the
# norm kernel rounds `s / rms` and then `(s / rms) * norm weight`.


def _check_one_row(
    name: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> int:
    """K, after the checks of a one-row product's arguments."""
    num_rows, k = x.shape
    if num_rows != 1:
        raise ValueError(f"{name}: one row only (got {num_rows})")
    assert weight.dtype == FP8_DTYPE and weight.is_contiguous() and weight.shape[1] == k
    assert x.stride(1) == 1 and weight_scale.dtype == torch.float32
    return int(k)


def _one_row_config(n_w: int, device: torch.device) -> GemvConfig:
    return dataclasses.replace(default_config(1, n_w, device), split_k=1, stages=0, preload=0)


def _unroll(cfg: GemvConfig) -> dict[str, int]:
    """The launch arguments of a one-row product at `cfg.unroll`."""
    if cfg.unroll > 1:
        return {"UNROLL": 2, "maxnreg": UNROLL_MAX_REGISTERS}
    return {"UNROLL": 1}


def fp8_gemv_add_norm(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    residual: torch.Tensor,  # [1, N] in x's dtype, contiguous: updated in place
    norm_weight: torch.Tensor,  # [N], the RMSNorm after the add
) -> tuple[torch.Tensor, torch.Tensor]:  # ([1, N] s * norm weight, [programs] float32)
    """`s = x @ W^T * scale + residual` (the product rounded to x's dtype, then the sum, as
    `add_rms_norm` rounds them), written into `residual`; returns `s * norm_weight` rounded
    and each program's sum of `s^2` over its columns, which `fp8_gemv_normed` takes."""
    k = _check_one_row("fp8_gemv_add_norm", x, weight, weight_scale)
    n = weight.shape[0]
    assert residual.shape == (1, n) and residual.is_contiguous() and residual.dtype == x.dtype
    assert norm_weight.shape == (n,) and norm_weight.is_contiguous()
    cfg = _one_row_config(n, x.device)
    programs = triton.cdiv(n, cfg.block_n)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    squares = torch.empty(programs, dtype=torch.float32, device=x.device)
    _fp8_gemv_kernel[(programs, 1, 1)](
        x, weight, weight_scale, weight_scale, out, out, 1, n, k, x.stride(0), out.stride(0), k,
        residual, norm_weight, squares, programs, 0.0,
        HAS_BIAS=False, ROWS=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=1,
        EVEN_K=k % cfg.block_k == 0, GATED=False, PRELOAD=False, ADD_NORM=True,
        **_unroll(cfg), num_warps=cfg.num_warps, num_stages=1, **pdl_launch(x.device),
    )  # fmt: skip
    return out, squares


def fp8_gemv_normed(
    x: torch.Tensor,  # [1, K]: s * norm weight, from fp8_gemv_add_norm
    squares: torch.Tensor,  # fp8_gemv_add_norm's sums of squares of s
    eps: float,  # the RMSNorm's
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:  # [1, N] ([1, N / 2] gated)
    """`fp8_gemv` of `RMSNorm(s)` from `s * norm weight`: the sums times
    `rsqrt(sum(squares) / K + eps)`, then the channel scale (and bias, and SiLU x up when
    `gated`, as `fp8_gemv`)."""
    k = _check_one_row("fp8_gemv_normed", x, weight, weight_scale)
    n_w = weight.shape[0]
    assert squares.dtype == torch.float32 and squares.dim() == 1 and squares.is_contiguous()
    if gated and n_w % 2:
        raise ValueError(f"gated: the weight's rows are [gate | up], an even count (got {n_w})")
    n = n_w // 2 if gated else n_w
    cfg = _one_row_config(n_w, x.device)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    num_squares = squares.shape[0]
    _fp8_gemv_kernel[(triton.cdiv(n_w, cfg.block_n), 1, 1)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, out,
        1, n, k, x.stride(0), out.stride(0), k,
        out, weight_scale, squares, num_squares, eps,
        HAS_BIAS=bias is not None, ROWS=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=1, EVEN_K=k % cfg.block_k == 0, GATED=gated, PRELOAD=False, NORMED=True,
        SQUARES_PAD=triton.next_power_of_2(num_squares), **_unroll(cfg),
        num_warps=cfg.num_warps, num_stages=1, **pdl_launch(x.device),
    )  # fmt: skip
    return out
