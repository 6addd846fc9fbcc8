"""FP8-weight products at a few rows (decode): `y = (x @ W_fp8^T) * w_scale (+ bias)` as a
matrix-vector product that streams W once at memory bandwidth.

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

from davit_engine.kernels import capability, interpreted, multiprocessors, zeroed_counters
from davit_engine.kernels.fp8 import hadamard_factors, hadamard_halves
from davit_engine.kernels.kv_cache import key_offsets, to_cache_e4m3, value_offsets
from davit_engine.kernels.layer_ops import norm_rope_halves, silu_times
from davit_engine.kernels.pdl import gdc_enter, pdl_launch
from davit_engine.layers.fp8 import FP8_DTYPE, is_fp8, rotates_keys

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

    @property
    def label(self) -> str:
        split = f"s{self.split_k}" if self.split_k else "sauto"
        stream = f"t{self.stages}" if self.stages else ""
        preload = "p" if self.preload else ""
        return f"gemv_{self.block_n}x{self.block_k}w{self.num_warps}{split}{stream}{preload}"


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


def default_config(num_rows: int, n: int, device: torch.device) -> GemvConfig:
    if num_rows > 1:
        return FEW_ROWS_CONFIG
    wanted = _PROGRAMS_PER_SM * multiprocessors(device)
    config = (
        ONE_ROW_CONFIG
        if triton.cdiv(n, ONE_ROW_CONFIG.block_n) >= wanted
        else ONE_ROW_NARROW_CONFIG
    )
    if STREAM_STAGES:
        config = dataclasses.replace(config, stages=STREAM_STAGES, preload=STREAM_PRELOAD)
    elif PLAIN_PRELOAD:
        config = dataclasses.replace(config, preload=1)
    return config


def can_stream(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> bool:
    """Whether `config` streams W here: asked for (`stages` >= 2), one row, the tensor memory
    accelerator's alignment (W's base and rows on 16 bytes) and a GPU that has one (sm_90+;
    or Triton's interpreter, which runs the same kernel on the CPU)."""
    if TensorDescriptor is None or config.stages < 2 or x.shape[0] != 1:
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
    head_counts_ptr,  # ROPE: the heads' finish (`_finish_head`; `fp8_gemv_rope`)
    q_out_ptr,
    cache_ptr,
    slot_ptr,
    kv_scale_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    qk_eps,
    value_offset,
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
    ROPE: tl.constexpr = False,
    NUM_Q_HEADS: tl.constexpr = 1,
    NUM_KV_HEADS: tl.constexpr = 1,
    HALF: tl.constexpr = 1,
    PAGE: tl.constexpr = 1,
    QK_NORM: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
    ROTATE_K: tl.constexpr = False,
    ROTATE_Q: tl.constexpr = False,
    HADAMARD_A: tl.constexpr = 1,
    HADAMARD_B: tl.constexpr = 1,
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
                acc2 += w_first.to(tl.float32) * x.to(tl.float32)
            k_loop += BLOCK_K
        for k0 in range(k_loop, k_end, BLOCK_K):
            kk = k0 + ks
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :])
                x = tl.load(x_row + kk[None, :])
            else:
                w = tl.load(w_rows + kk[None, :], mask=kk[None, :] < k_end, other=0.0)
                x = tl.load(x_row + kk[None, :], mask=kk[None, :] < k_end, other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)
        total = tl.sum(acc2, 1)[None, :]  # [1, BLOCK_N]
        if NORMED:  # x is s * norm weight: the RMSNorm's 1/rms of s applies to the sums
            parts = tl.arange(0, SQUARES_PAD)
            squares = tl.load(squares_ptr + parts, mask=parts < num_squares, other=0.0)
            total = total * tl.rsqrt(tl.sum(squares, 0) / K + eps)
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
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)
        total = tl.sum(acc, 2)  # [ROWS, BLOCK_N]
    if ADD_NORM:  # one row, one split, no bias, not gated (fp8_gemv_add_norm)
        _store_add_norm(total, cols, w_row, pid_n, N, scale_ptr, out_ptr, res_ptr, norm_w_ptr,
                        squares_ptr)  # fmt: skip
    else:
        _store_rows(total, rows, cols, w_row, pid_n, split, num_rows, N, scale_ptr, bias_ptr,
                    out_ptr, part_ptr, stride_om, HAS_BIAS, ROWS, BLOCK_N, SPLIT_K, GATED)  # fmt: skip
        if ROPE:  # one row, one split, not gated (fp8_gemv_rope)
            _finish_head(
                out_ptr, pid_n, head_counts_ptr, q_out_ptr, cache_ptr, slot_ptr, kv_scale_ptr,
                cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, qk_eps, value_offset, BLOCK_N,
                NUM_Q_HEADS, NUM_KV_HEADS, HALF, PAGE, QK_NORM, KV_FP8, ROTATE_K, ROTATE_Q,
                HADAMARD_A, HADAMARD_B,
            )  # fmt: skip


@triton.jit
def _store_add_norm(  # type: ignore[no-untyped-def]
    total, cols, w_row, pid_n, N, scale_ptr, out_ptr, res_ptr, norm_w_ptr, squares_ptr
):  # fmt: skip
    """One row's product `total` [1, BLOCK_N] (columns `cols`), scaled and rounded to the
    activation dtype, added to the residual stream as `layer_ops.add_rms_norm` adds it (the sum
    `s` rounded, written back in place); out: `s * norm weight` rounded, and the program's sum
    of `s^2` over its columns."""
    valid = (cols < N)[None, :]
    dtype = out_ptr.dtype.element_ty
    product = (total * tl.load(scale_ptr + w_row)[None, :]).to(dtype).to(tl.float32)
    dst = cols[None, :]
    residual = tl.load(res_ptr + dst, mask=valid, other=0.0).to(tl.float32)
    s = (product + residual).to(dtype)
    tl.store(res_ptr + dst, s, mask=valid)
    s32 = tl.where(valid, s.to(tl.float32), 0.0)
    norm_w = tl.load(norm_w_ptr + dst, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, (s32 * norm_w).to(dtype), mask=valid)
    tl.store(squares_ptr + pid_n, tl.sum(tl.sum(s32 * s32, 1), 0))


@triton.jit
def _finish_head(  # type: ignore[no-untyped-def]
    qkv_ptr, pid_n, head_counts_ptr, q_out_ptr, cache_ptr, slot_ptr, kv_scale_ptr, cos_ptr,
    sin_ptr, q_norm_ptr, k_norm_ptr, qk_eps, value_offset, BLOCK_N: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    PAGE: tl.constexpr, QK_NORM: tl.constexpr, KV_FP8: tl.constexpr, ROTATE_K: tl.constexpr,
    ROTATE_Q: tl.constexpr, HADAMARD_A: tl.constexpr, HADAMARD_B: tl.constexpr,
):  # fmt: skip
    """After a q/k/v program stored its outputs: the last of a head's programs to arrive (a
    count per head, release/acquire at GPU scope) reads the whole head back and finishes it as
    the rotary kernel would (`layer_ops.qk_norm_rope` with the cache written): a query head
    normed (QK_NORM), rotated (and times H with ROTATE_Q) into `q_out`; a key head normed,
    rotated, (times H and) quantized into the cache at the token's slot; a value head
    quantized into it. The count goes back to zero for the next launch."""
    PROGRAMS: tl.constexpr = 2 * HALF // BLOCK_N  # a head's programs
    head = pid_n // PROGRAMS
    tl.debug_barrier()  # every thread's stores precede the release
    arrived = tl.atomic_add(head_counts_ptr + head, 1, sem="acq_rel", scope="gpu")
    if arrived == PROGRAMS - 1:
        tl.atomic_xchg(head_counts_ptr + head, 0, sem="relaxed", scope="gpu")
        dtype = qkv_ptr.dtype.element_ty
        dims = tl.arange(0, HALF)[None, :]
        # the other programs' outputs, through L2 (this multiprocessor's L1 may hold stale
        # lines of these addresses)
        src = qkv_ptr + head * (2 * HALF) + dims
        x1 = tl.load(src, cache_modifier=".cg").to(tl.float32)
        x2 = tl.load(src + HALF, cache_modifier=".cg").to(tl.float32)
        slot = tl.load(slot_ptr).to(tl.int64)  # negative: a padding token, nothing stored
        cache_ty = cache_ptr.dtype.element_ty
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            c1 = tl.load(cos_ptr + dims).to(dtype).to(tl.float32)
            c2 = tl.load(cos_ptr + HALF + dims).to(dtype).to(tl.float32)
            s1 = tl.load(sin_ptr + dims).to(dtype).to(tl.float32)
            s2 = tl.load(sin_ptr + HALF + dims).to(dtype).to(tl.float32)
            if head < NUM_Q_HEADS:
                o1, o2 = norm_rope_halves(
                    x1, x2, q_norm_ptr, qk_eps, c1, c2, s1, s2, QK_NORM, HALF, dtype
                )
                if ROTATE_Q:  # q @ H rounded to the model dtype, as the rotary kernel's
                    o1, o2 = hadamard_halves(o1, o2, HALF, HADAMARD_A, HADAMARD_B)
                dst = q_out_ptr + head * (2 * HALF) + dims
                tl.store(dst, o1.to(dtype))
                tl.store(dst + HALF, o2.to(dtype))
            elif slot >= 0:
                kv_head = head - NUM_Q_HEADS
                o1, o2 = norm_rope_halves(
                    x1, x2, k_norm_ptr, qk_eps, c1, c2, s1, s2, QK_NORM, HALF, dtype
                )
                if KV_FP8:  # as kv_cache.store_token_kv stores it
                    if ROTATE_K:
                        o1, o2 = hadamard_halves(o1, o2, HALF, HADAMARD_A, HADAMARD_B)
                    k_scale = tl.load(kv_scale_ptr + kv_head)
                    o1 = to_cache_e4m3(o1, k_scale)
                    o2 = to_cache_e4m3(o2, k_scale)
                dst = cache_ptr + key_offsets(slot, kv_head, dims, NUM_KV_HEADS, 2 * HALF)
                tl.store(dst, o1.to(cache_ty))
                tl.store(dst + HALF, o2.to(cache_ty))
        elif slot >= 0:
            kv_head = head - NUM_Q_HEADS - NUM_KV_HEADS
            if KV_FP8:
                v_scale = tl.load(kv_scale_ptr + NUM_KV_HEADS + kv_head)
                x1 = to_cache_e4m3(x1, v_scale)
                x2 = to_cache_e4m3(x2, v_scale)
            dst = cache_ptr + value_offsets(
                slot, kv_head, dims, NUM_KV_HEADS, value_offset, PAGE, 2 * HALF, KV_FP8
            )
            tl.store(dst, x1.to(cache_ty))
            dst = cache_ptr + value_offsets(
                slot, kv_head, dims + HALF, NUM_KV_HEADS, value_offset, PAGE, 2 * HALF, KV_FP8
            )
            tl.store(dst, x2.to(cache_ty))


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
    assert weight.dtype == FP8_DTYPE and weight.is_contiguous() and weight.shape[1] == k
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
            out, weight_scale, weight_scale, 0, 0.0, *_no_rope(out),
            HAS_BIAS=bias is not None, ROWS=rows_per_program, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, SPLIT_K=split_k, EVEN_K=k % cfg.block_k == 0, GATED=gated,
            PRELOAD=bool(cfg.preload) and rows_per_program == 1 and k % cfg.block_k == 0,
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
        residual, norm_weight, squares, programs, 0.0, *_no_rope(out),
        HAS_BIAS=False, ROWS=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=1,
        EVEN_K=k % cfg.block_k == 0, GATED=False, PRELOAD=False, ADD_NORM=True,
        num_warps=cfg.num_warps, num_stages=1, **pdl_launch(x.device),
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
        out, weight_scale, squares, num_squares, eps, *_no_rope(out),
        HAS_BIAS=bias is not None, ROWS=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=1, EVEN_K=k % cfg.block_k == 0, GATED=gated, PRELOAD=False, NORMED=True,
        SQUARES_PAD=triton.next_power_of_2(num_squares),
        num_warps=cfg.num_warps, num_stages=1, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def _no_rope(t: torch.Tensor) -> tuple[object, ...]:
    """The ROPE arguments of `_fp8_gemv_kernel` at a launch without them (unused)."""
    return (t, t, t, t, t, t, t, t, t, 0.0, 0)


# ---- the q/k/v product that finishes its heads (rotary, cache write) ----------------------
#
# At one token the rotary kernel between q/k/v and attention reads back the product's 1,536
# values and writes the rotated queries and the cache: a launch of a few microseconds in
# every layer, most of it the latency of a dependent kernel. `fp8_gemv_rope` does that work
# in the product: each program stores its outputs as usual, then counts itself in for its head
# (a head's 2 * HALF rows are `2 * HALF / BLOCK_N` programs); the last of a head's programs
# reads the head back from L2 and finishes it with the rotary kernel's arithmetic
# (`layer_ops.norm_rope_halves`; an FP8 cache's keys and the queries for it rotated by
# `kernels.fp8.hadamard_halves` instead of a matrix-unit product, which would take shared
# memory from every program of the product).

_HEAD_COUNTS: dict[tuple[str, int | None], torch.Tensor] = {}


def head_counts(device: torch.device, heads: int) -> torch.Tensor | None:
    """The per-head arrival counts `fp8_gemv_rope` takes (`kernels.zeroed_counters`: one
    array a device, zero between launches; None inside a CUDA graph capture that would have to
    make them, where the caller runs the rotary kernel instead)."""
    return zeroed_counters(_HEAD_COUNTS, device, heads, 256)


def rope_config(num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> (
    GemvConfig | None
):  # fmt: skip
    """The tile `fp8_gemv_rope` runs for this q/k/v shape, or None where it cannot (a head dim
    that is not twice a power of two of at least 4, or not a whole number of tiles)."""
    half = head_dim // 2
    if head_dim % 2 or half < 4 or half & (half - 1):
        return None
    config = _one_row_config((num_q_heads + 2 * num_kv_heads) * head_dim, device)
    return config if head_dim % config.block_n == 0 else None


def fp8_gemv_rope(
    x: torch.Tensor,  # [1, K] (with `normed`: s * norm weight, from fp8_gemv_add_norm)
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K] float8_e4m3fn: q, k, v rows
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
    num_q_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,  # [D] of the token's position, contiguous, in x's dtype
    sin: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, page, Hkv, D]: x's dtype or FP8, contiguous
    slot_mapping: torch.Tensor,  # [1] int64, negative: padding (nothing stored)
    counts: torch.Tensor,  # head_counts(device, Hq + 2 Hkv)
    kv_scale: torch.Tensor | None = None,  # [2, Hkv] float32: an FP8 cache's
    q_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # q and k weights, eps
    rotate_queries: bool = False,
    normed: tuple[torch.Tensor, float] | None = None,  # the squares and eps (fp8_gemv_normed)
) -> torch.Tensor:  # [1, Hq, D]: the queries, rotated (times H with rotate_queries)
    """The one-row q/k/v product (`fp8_gemv`; with `normed`, `fp8_gemv_normed`'s) followed by
    what `layer_ops.qk_norm_rope(q, k, cos, sin, ..., v=v, kv_cache=kv_cache, ...)` does with
    its output, in one launch: the keys rotated and the values into the cache at the token's
    slot, the rotated queries returned. The same numbers as the two kernels, but for an FP8
    cache's rotation by H (float32 sums in another order: `kernels.fp8.hadamard_halves`)."""
    k = _check_one_row("fp8_gemv_rope", x, weight, weight_scale)
    head_dim = kv_cache.shape[-1]
    heads = num_q_heads + 2 * num_kv_heads
    n = weight.shape[0]
    if n != heads * head_dim:
        raise ValueError(
            f"fp8_gemv_rope: weight has {n} rows, not (Hq + 2 Hkv) * D = {heads * head_dim}"
        )
    cfg = rope_config(num_q_heads, num_kv_heads, head_dim, x.device)
    if cfg is None:
        raise ValueError(f"fp8_gemv_rope: head dim {head_dim} has no tile here")
    assert kv_cache.is_contiguous() and tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim)
    assert cos.is_contiguous() and sin.is_contiguous() and cos.numel() == head_dim
    assert counts.dtype == torch.int32 and counts.numel() >= heads
    fp8 = is_fp8(kv_cache.dtype)
    if not fp8 and kv_cache.dtype != x.dtype:
        raise ValueError(f"fp8_gemv_rope: a cache of {kv_cache.dtype} for {x.dtype} values")
    if fp8:
        assert kv_scale is not None and tuple(kv_scale.shape) == (2, num_kv_heads)
        assert kv_scale.dtype == torch.float32 and kv_scale.is_contiguous()
    rotate_k = fp8 and rotates_keys(head_dim)
    if rotate_queries and not rotate_k:
        raise ValueError("fp8_gemv_rope: rotate_queries is for an FP8 cache's rotated keys")
    squares, eps = normed if normed is not None else (weight_scale, 0.0)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    q_out = torch.empty(1, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    q_weight, k_weight, qk_eps = q_norm if q_norm is not None else (x, x, 0.0)
    ha, hb = hadamard_factors(head_dim // 2)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), 1, 1)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, out,
        1, n, k, x.stride(0), out.stride(0), k,
        out, weight_scale, squares, squares.numel(), eps,
        counts, q_out, kv_cache, slot_mapping, kv_scale if fp8 else weight_scale, cos, sin,
        q_weight, k_weight, qk_eps, kv_cache[0].numel(),
        HAS_BIAS=bias is not None, ROWS=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=1, EVEN_K=k % cfg.block_k == 0, GATED=False, PRELOAD=False,
        NORMED=normed is not None,
        SQUARES_PAD=triton.next_power_of_2(squares.numel()) if normed is not None else 1,
        ROPE=True, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        PAGE=kv_cache.shape[2], QK_NORM=q_norm is not None, KV_FP8=fp8, ROTATE_K=rotate_k,
        ROTATE_Q=rotate_queries, HADAMARD_A=ha, HADAMARD_B=hb,
        num_warps=cfg.num_warps, num_stages=1, **pdl_launch(x.device),
    )  # fmt: skip
    return q_out
