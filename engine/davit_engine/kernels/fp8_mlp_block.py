"""A decoder layer's second half at one token in one persistent kernel: the attention output's
FP8 o projection, the residual add and RMSNorm, the FP8 gate/up projection with SiLU x up,
the FP8 down projection, and the residual add and RMSNorm that end the layer.

At one token those are five kernels of a few microseconds to a few tens (o 7-8 us, gate/up
33-43, down 17-22 on an H100 or H200), and each boundary costs the next grid's launch and the
ramp of its memory stream: about 3.4 us a kernel beyond its bytes at W2's shapes (bench notes,
run 25). Here one launch holds every program at once (the grid is sized from the compiled
kernel's occupancy, at most `PROGRAMS_PER_SM` programs a multiprocessor), and the phases wait
on each other through counters in global memory instead of kernel boundaries:

    A  o = attn @ W_o^T * s_o               tiles of W_o spread over all programs
       -- every program arrives; all wait --
    B  s = o + residual; x = RMSNorm(s)     program 0 (one row: 8 KB), then a flag
    C  h = silu(gate) * up of x @ W_gu^T    tiles of W_gu over all programs
       -- every program arrives; all wait --
    D  y = h @ W_down^T * s_down            tiles of W_down over all programs
       -- every program arrives; program 0 waits --
    E  s' = y + s; x' = RMSNorm'(s')        program 0

A phase's tiles and arithmetic are those of `fp8_gemv` at one row (the same tile, warps and
order of sums) and `add_rms_norm`'s, so the outputs are bit for bit the unfused kernels'.

A barrier: the CTA's threads synchronize, one thread adds 1 to the phase's counter with
release semantics at GPU scope, then polls it with acquire semantics until every program has
arrived, and the CTA's threads go on after a fence. A phase reads values other programs wrote
only after the barrier that follows their writing, and no multiprocessor read those addresses
before in the launch, so no L1 line of them can be stale (the norms read through L2 anyway;
`X_CG` makes the products do so too). The last program to leave the kernel sets the counters back to zero, so the next launch (the
next step's graph replay) starts from zero without a memset. Every wait gives up after
`MAX_SPINS` polls and counts the failure in the counters' error slot instead of hanging the
GPU: the tests read it, and the host never launches more programs than can be resident. (The
runner does not read it: a wait that gave up would leave wrong numbers unreported, one more
reason the runner's switch stays off until the block wins.)

Under Triton's interpreter (the CPU) programs run one after another, so a barrier would never
release: there each phase is its own launch (`fused=False`), the same code without barriers.

Status (bench notes, runs 26 and 27): correct (bit for bit in captured graphs on an H100 and
an H200; W2 decoded the same 256 tokens as without it) and slower than the five kernels it
replaces, so the runner's switch (`fused_layers.PERSISTENT_FP8_MLP`) is off. On an H100 the
best form (`MAX_REGISTERS` 64: 1,056 programs) took 90.35 us a layer against their 75.66, and W2
ran at 246.2 decode tok/s against 277.2. Its timeline (`trace`) shows where: gate/up and down
stream slower inside the block than as kernels (46.5 and 24.0 us against 42.6 and 22.4), and the
barriers and the norm take 8.5 us a layer. Two K steps' loads at once (`K_UNROLL`: 93.21 us),
x through L2 only (`X_CG`: 133.88) and 4 programs a multiprocessor (96.69) were slower. Without
the register cap (80 registers, 792 programs by the occupancy query) one program started 1.7 s
after the first and waits gave up: that grid was not all resident at once, for a reason not
known.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from davit_engine.kernels import capability, interpreted, multiprocessors
from davit_engine.kernels.fp8_gemv import (
    GemvConfig,
    _store_rows,
    default_config,
    default_split_k,
)
from davit_engine.kernels.layer_ops import _round
from davit_engine.kernels.pdl import gdc_enter, pdl_launch
from davit_engine.layers.fp8 import FP8_DTYPE

try:  # round-to-nearest multiply that is never contracted into a fused multiply-add
    from triton.language.extra.cuda.libdevice import mul_rn as _mul_rn
except ImportError:  # pragma: no cover - depends on the installed Triton
    _mul_rn = None

# Programs per multiprocessor at most (fewer where the compiled kernel's registers or shared
# memory do not allow that many resident at once): the unfused one-row products keep up to 8
# of theirs resident, and a phase streams W only as fast as its programs keep loads in flight.
PROGRAMS_PER_SM = 8
# Polls of a counter before a wait gives up (and counts an error): far beyond any real wait
# (a poll is an L2 round trip, ~1 us), short enough that a broken barrier shows as an error.
MAX_SPINS = 1 << 22
# Whether the products read their input through L2 only (`.cg`), and whether they issue two K
# steps' loads at once where K allows (`_gemv_tiles`' UNROLL). Switches so that a benchmark can
# time each; both were slower on an H100 (run 27: 133.88 and 93.21 us a layer against 90.35).
X_CG = False
K_UNROLL = 1
# Registers a thread at most (None: the compiler's choice). Compiled for sm_90 (Triton 3.6) the
# kernel takes 80, so 6 programs of 4 warps fit a multiprocessor: 792 on 132, which leaves o's
# and down's 1,024 tiles at two for some programs. At 64, 8 fit (1,056 programs: one tile of o
# and of down each, at most four of gate/up's 3,584) and 88 bytes spill, in the tile loops'
# set-up and the norms, not in the K loops. On an H100 (run 27) 90.35 us a layer at 64 against
# 107.99 uncapped. A switch for the bench.
MAX_REGISTERS: int | None = 64
# Timer stamps a program writes when traced: after its wait for the kernel before, after the o
# tiles, after the barrier that follows, after the norm's flag (program 0: after the norm),
# after the gate/up tiles, after the barrier, after the down tiles, at the end.
TRACE_SLOTS = 8
_TRACE_SLOTS = tl.constexpr(TRACE_SLOTS)
# Counter slots: barriers after A, B (a flag), C and D; programs that left; errors.
_C_O, _C_NORM, _C_GU, _C_DOWN, _C_EXIT, _C_ERROR = range(6)
NUM_COUNTERS = 8
# Phases, for the launches one phase at a time.
PHASE_O, PHASE_NORM, PHASE_GATE_UP, PHASE_DOWN, PHASE_NORM_OUT, ALL_PHASES = range(6)


@triton.jit
def _arrive(counter_ptr):  # type: ignore[no-untyped-def]
    tl.debug_barrier()  # every thread's stores of the phase precede the release
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _asm_step(ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """Run one PTX statement (a fence) in every thread; kept by the compiler."""
    tl.inline_asm_elementwise(
        ASM + " mov.b32 $0, $1;", "=r,r", [tl.full([1], 0, tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _wait(counter_ptr, target, error_ptr, MAX_SPINS: tl.constexpr):  # type: ignore[no-untyped-def]
    # Polled by one thread: Triton compiles an acquiring add of 0 to an acquire load at GPU
    # scope by one thread, its value shared through shared memory (volatile loads by every
    # thread with a sleep between polls gave up waits at Llama-3.1-8B's shapes on an H100 and
    # an H200: bench notes, run 26); then a fence before the CTA's threads go on together.
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.atomic_add(error_ptr, 1, sem="relaxed", scope="gpu")
    _asm_step("fence.acq_rel.gpu;")
    tl.debug_barrier()


@triton.jit
def _load_x(ptrs, X_CG: tl.constexpr):  # type: ignore[no-untyped-def]
    if X_CG:
        return tl.load(ptrs, cache_modifier=".cg")
    return tl.load(ptrs)


@triton.jit
def _stamp(trace_ptr, pid, SLOT: tl.constexpr, TRACE: tl.constexpr):  # type: ignore[no-untyped-def]
    """TRACE: the global nanosecond timer into this program's SLOT of the trace rows."""
    if TRACE:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,l", [tl.full([1], 0, tl.int64)], dtype=tl.int64,
            is_pure=False, pack=1,
        )  # fmt: skip
        tl.store(trace_ptr + pid * _TRACE_SLOTS + SLOT + tl.arange(0, 1), now)


@triton.jit
def _gemv_tiles(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, scale_ptr, out_ptr, N, K, first, step,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr, X_CG: tl.constexpr,
    UNROLL: tl.constexpr,
):  # fmt: skip
    """Tiles `first, first + step, ...` of the one-row product `x @ W^T * scale` (GATED: W is
    [gate | up], 2N rows, and the output silu(gate) * up), each as `fp8_gemv`'s one-row program
    `pid_n` computes it. x was written by other programs in this launch, after the barrier
    before this phase; no multiprocessor read its addresses before in the launch, so its L1
    holds no stale line of it (X_CG: read through L2 regardless). UNROLL 2: two K steps' loads
    issued before either step's multiply-adds (twice the bytes in flight a program; the sums
    in the same order; K a whole number of double steps)."""
    lanes = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, 1)
    num_tiles = tl.cdiv(2 * N if GATED else N, BLOCK_N)
    for pid_n in range(first, num_tiles, step):
        cols = pid_n * (BLOCK_N // 2) + lanes // 2 if GATED else pid_n * BLOCK_N + lanes
        w_row = tl.minimum(cols, N - 1)
        if GATED:
            w_row += (lanes % 2) * N
        w_rows = w_ptr + w_row.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
        x_row = x_ptr + (cols * 0)[:, None]  # [BLOCK_N, 1]: x in W's layout
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, UNROLL * BLOCK_K):
            kk = k0 + ks
            w = tl.load(w_rows + kk[None, :])
            x = _load_x(x_row + kk[None, :], X_CG)
            if UNROLL == 2:
                w_next = tl.load(w_rows + (kk + BLOCK_K)[None, :])
                x_next = _load_x(x_row + (kk + BLOCK_K)[None, :], X_CG)
                acc2 += w.to(tl.float32) * x.to(tl.float32)
                acc2 += w_next.to(tl.float32) * x_next.to(tl.float32)
            else:
                acc2 += w.to(tl.float32) * x.to(tl.float32)
        total = tl.sum(acc2, 1)[None, :]  # [1, BLOCK_N]
        _store_rows(total, rows, cols, w_row, pid_n, 0, 1, N, scale_ptr, scale_ptr, out_ptr,
                    out_ptr, 0, False, 1, BLOCK_N, 1, GATED)  # fmt: skip


@triton.jit
def _product_phase(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, scale_ptr, out_ptr, N, K, pid, num_programs, counter_ptr, error_ptr,
    trace_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
    X_CG: tl.constexpr, UNROLL: tl.constexpr, RUN: tl.constexpr, FUSED: tl.constexpr,
    WAIT: tl.constexpr, SLOT: tl.constexpr, MAX_SPINS: tl.constexpr, TRACE: tl.constexpr,
):  # fmt: skip
    """A product phase (RUN: this launch runs it): this program's tiles, a stamp; FUSED: the
    arrival at the phase's counter, and (WAIT) the wait for every program and a second stamp."""
    if RUN:
        _gemv_tiles(x_ptr, w_ptr, scale_ptr, out_ptr, N, K, pid, num_programs, BLOCK_N,
                    BLOCK_K, GATED, X_CG, UNROLL)  # fmt: skip
    _stamp(trace_ptr, pid, SLOT, TRACE)
    if FUSED:
        _arrive(counter_ptr)
        if WAIT:
            _wait(counter_ptr, num_programs, error_ptr, MAX_SPINS)
    if WAIT:
        _stamp(trace_ptr, pid, SLOT + 1, TRACE)


@triton.jit
def _add_rms_norm_row(  # type: ignore[no-untyped-def]
    x_ptr, residual_ptr, sum_ptr, weight_ptr, out_ptr, eps,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, SQUARE_RN: tl.constexpr,
):  # fmt: skip
    """`layer_ops.add_rms_norm` of one row, as its one-row program computes it. SQUARE_RN: the
    squares by an uncontracted multiply (this kernel contracts multiply-adds elsewhere; the
    norm kernel does not)."""
    rows = tl.arange(0, 1)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < 1)[:, None] & (dims[None, :] < DIM)
    dst = rows[:, None] * DIM + dims[None, :]
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + dst, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    r = tl.load(residual_ptr + dst, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    x = _round(x + r, dtype)
    tl.store(sum_ptr + dst, x.to(dtype), mask=mask)
    squares = _mul_rn(x, x) if SQUARE_RN else x * x
    variance = tl.sum(squares, 1) / DIM
    normed = _round(x * tl.rsqrt(variance + eps)[:, None], dtype)
    w = tl.load(weight_ptr + dims, mask=dims < DIM, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, (normed * w[None, :]).to(dtype), mask=mask)


@triton.jit
def _mlp_block_kernel(  # type: ignore[no-untyped-def]
    attn_ptr,  # [q_size] the attention output (the o projection's input)
    residual_ptr,  # [H] the residual stream before this layer's attention add
    o_w_ptr, o_s_ptr,  # [H, q_size] fp8, [H] fp32
    post_w_ptr,  # [H] post-attention norm weight
    gu_w_ptr, gu_s_ptr,  # [2I, H] fp8 ([gate | up]), [2I] fp32
    down_w_ptr, down_s_ptr,  # [H, I] fp8, [H] fp32
    next_w_ptr,  # [H] the norm after the layer (the next layer's input norm, or the final)
    o_ptr, sum1_ptr, x1_ptr, h_ptr, y_ptr,  # scratch: [H], [H], [H], [I], [H]
    sum2_ptr, x2_ptr,  # outputs: [H] the residual stream after the layer, [H] its norm
    counter_ptr,  # [NUM_COUNTERS] int32, zero at launch; zero again when the kernel ends
    trace_ptr,  # TRACE: [programs, TRACE_SLOTS] int64 timer stamps
    post_eps, next_eps,
    num_programs,
    H: tl.constexpr, Q: tl.constexpr, INTER: tl.constexpr, BLOCK_H: tl.constexpr,
    O_BN: tl.constexpr, O_BK: tl.constexpr, GU_BN: tl.constexpr, GU_BK: tl.constexpr,
    D_BN: tl.constexpr, D_BK: tl.constexpr, PHASE: tl.constexpr, SQUARE_RN: tl.constexpr,
    MAX_SPINS: tl.constexpr, X_CG: tl.constexpr, O_UNROLL: tl.constexpr,
    GU_UNROLL: tl.constexpr, D_UNROLL: tl.constexpr, TRACE: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    fused: tl.constexpr = PHASE == 5
    errors = counter_ptr + 5
    gdc_enter(USE_GDC)
    _stamp(trace_ptr, pid, 0, TRACE)
    _product_phase(attn_ptr, o_w_ptr, o_s_ptr, o_ptr, H, Q, pid, num_programs, counter_ptr + 0,
                   errors, trace_ptr, O_BN, O_BK, False, X_CG, O_UNROLL, fused or PHASE == 0,
                   fused, True, 1, MAX_SPINS, TRACE)  # fmt: skip
    if fused or PHASE == 1:  # noqa: SIM102 - a constexpr, then a value (Triton)
        if pid == 0:
            _add_rms_norm_row(o_ptr, residual_ptr, sum1_ptr, post_w_ptr, x1_ptr, post_eps,
                              H, BLOCK_H, SQUARE_RN)  # fmt: skip
            if fused:
                _arrive(counter_ptr + 1)
    if fused:  # noqa: SIM102
        if pid != 0:
            _wait(counter_ptr + 1, 1, errors, MAX_SPINS)
    _stamp(trace_ptr, pid, 3, TRACE)
    _product_phase(x1_ptr, gu_w_ptr, gu_s_ptr, h_ptr, INTER, H, pid, num_programs,
                   counter_ptr + 2, errors, trace_ptr, GU_BN, GU_BK, True, X_CG, GU_UNROLL,
                   fused or PHASE == 2, fused, True, 4, MAX_SPINS, TRACE)  # fmt: skip
    # after down, only program 0 waits (below: it finishes the layer alone)
    _product_phase(h_ptr, down_w_ptr, down_s_ptr, y_ptr, H, INTER, pid, num_programs,
                   counter_ptr + 3, errors, trace_ptr, D_BN, D_BK, False, X_CG, D_UNROLL,
                   fused or PHASE == 3, fused, False, 6, MAX_SPINS, TRACE)  # fmt: skip
    if fused or PHASE == 4:  # noqa: SIM102
        if pid == 0:
            if fused:
                _wait(counter_ptr + 3, num_programs, errors, MAX_SPINS)
            _add_rms_norm_row(y_ptr, sum1_ptr, sum2_ptr, next_w_ptr, x2_ptr, next_eps,
                              H, BLOCK_H, SQUARE_RN)  # fmt: skip
    _stamp(trace_ptr, pid, 7, TRACE)
    if fused:
        # The last program out has seen every other program leave its waits: it zeroes the
        # barriers for the next launch (the error count stays for the host to read).
        left = tl.atomic_add(counter_ptr + 4, 1, sem="acq_rel", scope="gpu")
        if left == num_programs - 1:
            for slot in tl.static_range(5):
                tl.atomic_xchg(counter_ptr + slot, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class MlpBlockWeights:
    """One decoder layer's tensors for `fp8_mlp_block` (FP8 weights with per-output-channel
    float32 scales, no biases)."""

    o_weight: torch.Tensor  # [H, Q]
    o_scale: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    post_eps: float
    gate_up_weight: torch.Tensor  # [2I, H]
    gate_up_scale: torch.Tensor  # [2I]
    down_weight: torch.Tensor  # [H, I]
    down_scale: torch.Tensor  # [H]
    next_norm: torch.Tensor  # [H]
    next_eps: float


def tile_configs(w: MlpBlockWeights, device: torch.device) -> tuple[GemvConfig, ...]:
    """The o, gate/up and down phases' tiles: `fp8_gemv`'s one-row choices for these shapes
    on `device`, so that each phase computes what the unfused product computes (the block's
    own `K_UNROLL` in place of the product's two steps a round: the same sums either way)."""
    return tuple(
        dataclasses.replace(default_config(1, weight.shape[0], device), unroll=1)
        for weight in (w.o_weight, w.gate_up_weight, w.down_weight)
    )


def check_shapes(
    w: MlpBlockWeights, device: torch.device, configs: tuple[GemvConfig, ...] | None = None
) -> str | None:
    """Why these tensors cannot run the block on `device` (None: they can). The tiles
    (`configs`, else `tile_configs`) are whole: every K a multiple of its tile's K step and
    every output count of its rows; the unfused products run unsplit there (else their sums'
    order differs); one warp count serves every phase."""
    h, q = w.o_weight.shape
    two_i, h_gu = w.gate_up_weight.shape
    h_down, inter = w.down_weight.shape
    for name, t in (("o", w.o_weight), ("gate_up", w.gate_up_weight), ("down", w.down_weight)):
        if t.dtype != FP8_DTYPE or not t.is_contiguous():
            return f"{name} weight must be contiguous float8_e4m3fn (got {t.dtype})"
    if h_gu != h or h_down != h or two_i != 2 * inter:
        return (
            f"shapes do not chain: o {tuple(w.o_weight.shape)}, gate_up {(two_i, h_gu)}, "
            f"down {(h_down, inter)}"
        )
    configs = configs or tile_configs(w, device)
    if len({config.num_warps for config in configs}) != 1:
        return "the phases' tiles need one warp count"
    for name, config, (n, k) in zip(
        ("o", "gate_up", "down"),
        configs,
        ((h, q), (two_i, h), (h, inter)),
        strict=True,
    ):
        if k % config.block_k or n % config.block_n:
            return f"{name} [{n}, {k}] is not a whole number of {config.label} tiles"
        if default_split_k(n, k, config, device) != 1:
            return f"{name} [{n}, {k}]: the unfused product splits K here"
    for name, t, n in (("o", w.o_scale, h), ("gate_up", w.gate_up_scale, two_i),
                       ("down", w.down_scale, h)):  # fmt: skip
        if t.dtype != torch.float32 or t.shape != (n,):
            return f"{name} scale must be float32 [{n}] (got {t.dtype} {tuple(t.shape)})"
    return None


def new_counters(device: torch.device) -> torch.Tensor:
    """A launch site's counters (zero; each launch leaves them zero again). Make them outside a
    CUDA graph capture and keep them as long as the site launches."""
    return torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)


# CUfunction_attribute CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, and its value for
# the largest shared memory carveout
_CARVEOUT_ATTRIBUTE = 9
_MAX_CARVEOUT = 100


def occupancy(function: int, num_warps: int, shared: int) -> int:
    """Programs of the loaded kernel `function` (a CUfunction handle) that one multiprocessor
    holds at once, asked of the driver after preferring the largest shared memory carveout
    (else the driver may pick a smaller one at launch, and fewer programs fit than counted
    from registers and shared memory alone)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p(function)
    status = cuda.cuFuncSetAttribute(handle, _CARVEOUT_ATTRIBUTE, _MAX_CARVEOUT)
    if status != 0:
        raise RuntimeError(f"fp8_mlp_block: cuFuncSetAttribute failed ({status})")
    blocks = ctypes.c_int(0)
    status = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), handle, 32 * num_warps, ctypes.c_size_t(shared)
    )
    if status != 0:
        raise RuntimeError(f"fp8_mlp_block: the driver's occupancy query failed ({status})")
    return blocks.value


def fp8_mlp_block(
    attn: torch.Tensor,  # [1, Q] the attention output, in the activation dtype
    residual: torch.Tensor,  # [1, H]
    w: MlpBlockWeights,
    counters: torch.Tensor,  # `new_counters`
    fused: bool | None = None,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', s'): s = attn @ W_o^T + residual, x = RMSNorm(s), s' = s + down(silu(gate) * up of
    x), x' = RMSNorm'(s') -- `fp8_gemv`'s products and `add_rms_norm`'s norms at one token, bit
    for bit, in one persistent launch (`fused`, the default on a GPU) or one launch per phase
    (the default under Triton's interpreter).

    `trace` (fused only): an int64 tensor of at least `32 * multiprocessors` rows of
    `TRACE_SLOTS`; the launch writes each program's timer stamps into its row (`last_programs`
    rows are written)."""
    if attn.shape[0] != 1 or residual.shape[0] != 1:
        raise ValueError(f"one token only (got attn {tuple(attn.shape)}, residual "
                         f"{tuple(residual.shape)})")  # fmt: skip
    o_cfg, gu_cfg, d_cfg = configs = tile_configs(w, attn.device)
    problem = check_shapes(w, attn.device, configs)
    if problem is not None:
        raise ValueError(f"fp8_mlp_block: {problem}")
    h, q = w.o_weight.shape
    inter = w.down_weight.shape[1]
    if attn.shape[1] != q or residual.shape[1] != h or not attn.is_contiguous():
        raise ValueError(f"attn must be contiguous [1, {q}] and residual [1, {h}]")
    if fused is None:
        fused = not interpreted()
    if fused and interpreted():
        raise ValueError("fused: the interpreter runs programs one after another; use fused=False")
    dev, dtype = attn.device, attn.dtype
    if trace is not None:
        rows = 32 * multiprocessors(dev)
        if not fused or trace.dtype != torch.int64 or trace.device != dev:
            raise ValueError("trace: an int64 tensor on the block's device, with fused=True")
        if not trace.is_contiguous() or tuple(trace.shape) != (rows, TRACE_SLOTS):
            raise ValueError(f"trace must be contiguous [{rows}, {TRACE_SLOTS}]")
    residual = residual.contiguous()
    scratch = torch.empty(4 * h + inter, dtype=dtype, device=dev)
    o, sum1, x1, y = (scratch[i * h : (i + 1) * h] for i in range(4))
    hidden_act = scratch[4 * h :]
    sum2 = torch.empty(1, h, dtype=dtype, device=dev)
    x2 = torch.empty(1, h, dtype=dtype, device=dev)
    square_rn = dev.type == "cuda" and not interpreted() and _mul_rn is not None
    args = (attn, residual, w.o_weight, w.o_scale, w.post_norm, w.gate_up_weight,
            w.gate_up_scale, w.down_weight, w.down_scale, w.next_norm, o, sum1, x1,
            hidden_act, y, sum2, x2, counters, trace if trace is not None else counters,
            w.post_eps, w.next_eps)  # fmt: skip
    consts = dict(H=h, Q=q, INTER=inter, BLOCK_H=triton.next_power_of_2(h),
                  O_BN=o_cfg.block_n, O_BK=o_cfg.block_k, GU_BN=gu_cfg.block_n,
                  GU_BK=gu_cfg.block_k, D_BN=d_cfg.block_n, D_BK=d_cfg.block_k,
                  SQUARE_RN=square_rn, MAX_SPINS=MAX_SPINS, X_CG=X_CG,
                  O_UNROLL=_unroll(q, o_cfg), GU_UNROLL=_unroll(h, gu_cfg),
                  D_UNROLL=_unroll(inter, d_cfg), TRACE=trace is not None,
                  num_warps=o_cfg.num_warps, num_stages=1)  # fmt: skip
    if MAX_REGISTERS is not None and fused:
        consts["maxnreg"] = MAX_REGISTERS
    launch = pdl_launch(dev)
    if not fused:
        programs = PROGRAMS_PER_SM * multiprocessors(dev)
        for phase in range(PHASE_NORM_OUT + 1):
            _mlp_block_kernel[(programs,)](*args, programs, PHASE=phase, **consts, **launch)
        return x2, sum2
    programs = resident_programs(dev, args, consts)
    global last_programs
    last_programs = programs
    _mlp_block_kernel[(programs,)](*args, programs, PHASE=ALL_PHASES, **consts, **launch)
    return x2, sum2


def _unroll(k: int, config: GemvConfig) -> int:
    """`K_UNROLL` where K is a whole number of its double steps, else 1."""
    return 2 if K_UNROLL == 2 and (k // config.block_k) % 2 == 0 else 1


def resident_programs(device: torch.device, args: tuple[object, ...], consts: dict) -> int:
    """The fused launch's grid: every program resident at once (the barriers need that), at
    most `PROGRAMS_PER_SM` a multiprocessor."""
    key = (tuple(sorted(consts.items())), PROGRAMS_PER_SM, device.index)
    cached = _GRID.get(key)
    if cached is not None:
        return cached
    compiled = _mlp_block_kernel.warmup(*args, 1, PHASE=ALL_PHASES, grid=(1,), **consts,
                                        **pdl_launch(device))  # fmt: skip
    compiled._init_handles()
    resident = occupancy(
        int(compiled.function), int(consts["num_warps"]), int(compiled.metadata.shared)
    )
    per_sm = min(PROGRAMS_PER_SM, resident)
    if per_sm < 1:
        raise RuntimeError("fp8_mlp_block: the compiled kernel does not fit a multiprocessor")
    programs = per_sm * multiprocessors(device)
    _GRID[key] = programs
    return programs


_GRID: dict[tuple[object, ...], int] = {}
# The grid of the last fused launch (for benchmarks' reports).
last_programs = 0


def supported(device: torch.device) -> bool:
    """Whether the fused launch can run on `device`: a GPU with FP8 conversions (sm_89+),
    outside Triton's interpreter, and not under an MPS limit on the threads a process may
    use (the grid is sized from the whole GPU's multiprocessors; fewer would leave programs
    unresident and the waits would give up)."""
    if os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        return False
    return device.type == "cuda" and not interpreted() and capability(device) >= (8, 9)
