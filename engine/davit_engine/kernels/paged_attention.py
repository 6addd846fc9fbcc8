"""Paged attention over the block-table KV cache: one Triton kernel for prefill, mixed and decode.

Each program owns one request, one tile of its new tokens and one KV head. The rows of its query
tile are (token, query head of that KV head's group) pairs, so grouped-query heads share every
key/value load and a decode step still fills a 16-row matrix tile. Keys are gathered page by page
through the block table, causally (a new token at absolute position p sees keys at positions
<= p, the cached prefix included). For long contexts with few programs (decode at small batch)
the key range is split over `num_splits` programs whose partial results a second kernel merges
by their log-sum-exp.

An FP8 cache (`float8_e4m3fn`, see `kernels/kv_cache.py`) is read at half the bytes: each tile is
widened exactly to fp16 with the hardware conversion (sm_89+: one instruction per pair of
values; every e4m3 value is an fp16 value), and the dot products run in fp16 with fp32
accumulation (the queries clamped into fp16's range; fp32 models stay in fp32). The program's
per-head scales apply once, to the scores (`q.(s k) = s (q.k)`) and to the output (`v_scale`),
since both are constant within a program (one KV head), never per element. Its keys are stored
Hadamard-rotated, so each program rotates its query tile the same way (`q @ H`, the matrix made
in registers; or the caller passes the queries rotated, `queries_rotated`) and divides the
scores by the head dim (`H @ H^T = D * I`). Its values are
stored key-minor in each block, so a value tile is read as 16-byte runs of keys and enters the
product as the keys do (e4m3 bytes in the matrix unit's operand layout, widened there) instead
of being widened, staged through shared memory as fp16 and read back transposed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from davit_engine.kernels import multiprocessors
from davit_engine.kernels.fp8 import hadamard_tile, to_f16_saturated
from davit_engine.kernels.pdl import gdc_enter, pdl_launch
from davit_engine.layers.fp8 import fp8_values_by_key, hadamard, is_fp8, rotates_keys

_LOG2E = 1.4426950408889634


@triton.jit
def _fp8_value_runs(  # type: ignore[no-untyped-def]
    table_row, tile, kv_end, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """The block-table entries of an FP8 value tile's runs of keys (`_fp8_values_tile`), -1
    past `kv_end`."""
    RUN: tl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    RUNS: tl.constexpr = BLOCK_N // RUN
    run_start = tile * BLOCK_N + tl.arange(0, RUNS) * RUN
    return tl.load(table_row + run_start // PAGE, mask=run_start < kv_end, other=-1)


@triton.jit
def _fp8_values_tile(  # type: ignore[no-untyped-def]
    v_cache_ptr, table_row, tile, kv_end, kv_head, dims, dim_valid, stride_cache_block,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    runs_block, RUNS_GIVEN: tl.constexpr,
):  # fmt: skip
    """An FP8 cache's values for keys `tile * BLOCK_N + [0, BLOCK_N)`, as [BLOCK_N, BLOCK_D].

    They are stored key-minor in each block (`[heads, dim, key]`, kernels/kv_cache.py), so the
    tile is read as runs of min(PAGE, BLOCK_N) contiguous keys: one block-table entry per run,
    and a mask per run (keys past `kv_end` inside a run are read too; a zeroed cache keeps them
    finite and their probabilities are zero), which lets each run be wide loads (16 bytes at
    pages of 16)."""
    RUN: tl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    RUNS: tl.constexpr = BLOCK_N // RUN
    run_start = tile * BLOCK_N + tl.arange(0, RUNS) * RUN  # first key of each run
    run_valid = run_start < kv_end
    if RUNS_GIVEN:  # loaded ahead by the caller (`_fp8_value_runs`)
        block = runs_block
    else:
        block = tl.load(table_row + run_start // PAGE, mask=run_valid, other=-1)
    run_valid = run_valid & (block >= 0)
    base = block.to(tl.int64) * stride_cache_block + kv_head * (HEAD_DIM * PAGE) + run_start % PAGE
    in_run = tl.arange(0, RUN)
    # [BLOCK_D, RUNS, RUN]
    offs = base[None, :, None] + (dims * PAGE)[:, None, None] + in_run[None, None, :]
    vt = tl.load(
        v_cache_ptr + offs,
        mask=dim_valid[:, None, None] & run_valid[None, :, None],
        other=0.0,
    )
    return tl.trans(tl.reshape(vt, [BLOCK_D, BLOCK_N]))


@triton.jit
def _values_tile(  # type: ignore[no-untyped-def]
    v_cache_ptr, kv_offs, key_valid, table_row, tile, kv_end, kv_head, dims, dim_valid,
    stride_cache_block, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, FP8: tl.constexpr, runs_block, RUNS_GIVEN: tl.constexpr,
):  # fmt: skip
    """The values of keys `tile * BLOCK_N + [0, BLOCK_N)` as [BLOCK_N, BLOCK_D]: an FP8 cache's
    key-minor runs (their block-table entries `runs_block` where RUNS_GIVEN), or a model-dtype
    cache's rows at `kv_offs`."""
    if FP8:
        return _fp8_values_tile(
            v_cache_ptr, table_row, tile, kv_end, kv_head, dims, dim_valid, stride_cache_block,
            BLOCK_N, BLOCK_D, PAGE, HEAD_DIM, runs_block, RUNS_GIVEN,
        )  # fmt: skip
    else:
        return tl.load(
            v_cache_ptr + kv_offs[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )


@triton.jit
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    kv_scale_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_block,
    num_q_tiles,
    num_requests,
    split_programs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BALANCED: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY_V: tl.constexpr,
    FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    Q_ROTATED: tl.constexpr,
    F16_DOT: tl.constexpr,
    EARLY: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # EARLY: the step's metadata (query offsets, lengths, block tables) and the scales are read
    # before the wait for the kernel before (none of them is its output; pdl.py), and each key
    # tile's block-table entries one tile ahead, so that a short split's chain of dependent
    # loads after the wait is the queries and the key and value tiles alone.
    if not EARLY:
        gdc_enter(USE_GDC)
    pid = tl.program_id(0)
    req = pid // num_q_tiles
    q_tile = pid % num_q_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # the request's metadata and this program's run of key tiles (before the wait if EARLY)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    if FP8:
        k_scale = tl.load(kv_scale_ptr + kv_head)
        v_scale = tl.load(kv_scale_ptr + NUM_KV_HEADS + kv_head)
    ctx_len = seq_len - q_len  # keys cached before this step
    last_tok = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    kv_end = tl.minimum(seq_len, ctx_len + last_tok)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if BALANCED:  # the same run of tiles for every request's splits
        tiles_per_split = _balanced_split_tiles(
            seq_lens_ptr, num_requests, split_programs, NUM_KV_HEADS, NUM_SPLITS, BLOCK_N,
            MIN_SPLIT_TILES,
        )  # fmt: skip
    else:  # each request's tiles in NUM_SPLITS runs
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    if EARLY:  # the first tile's block-table entries, then the wait
        next_keys = tile_begin * BLOCK_N + tl.arange(0, BLOCK_N)
        next_block = tl.load(table_row + next_keys // PAGE, mask=next_keys < kv_end, other=-1)
        if FP8:
            next_runs = _fp8_value_runs(table_row, tile_begin, kv_end, BLOCK_N, PAGE)
        else:
            next_runs = next_block
        gdc_enter(USE_GDC)
    if q_tile * BLOCK_Q < q_len:
        rows = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + rows // GROUP_PAD  # token index within the request
        head_in_group = rows % GROUP_PAD
        row_valid = (tok < q_len) & (head_in_group < GROUP)
        q_head = kv_head * GROUP + head_in_group
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM

        q_offs = (q_begin + tok).to(tl.int64)[:, None] * stride_qt + q_head[:, None] * stride_qh
        # q: [BLOCK_M, BLOCK_D]
        q = tl.load(
            q_ptr + q_offs + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        q_pos = ctx_len + tok
        if FP8:  # the per-head key scale folds into the score scale
            scale_log2 = scale_log2 * k_scale
        if ROTATE:  # keys are stored as k @ H: match them with q @ H, and H H^T = D I
            if not Q_ROTATED:  # (rotated already by the caller: no tile for H here)
                q = tl.dot(q, hadamard_tile(BLOCK_D, q.dtype), input_precision=DOT_PRECISION)
                q = q.to(q_ptr.dtype.element_ty)
            scale_log2 = scale_log2 * (1.0 / HEAD_DIM)
        if F16_DOT:
            q = to_f16_saturated(q)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for tile in range(tile_begin, tile_end):
            keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_valid = keys < kv_end
            if EARLY:  # this tile's entries were loaded a tile ahead; load the next tile's
                block = next_block
                runs_block = next_runs
                ahead = keys + BLOCK_N
                ahead_end = tl.where(tile + 1 < tile_end, kv_end, 0)  # none past the split
                next_block = tl.load(table_row + ahead // PAGE, mask=ahead < ahead_end, other=-1)
                if FP8:
                    next_runs = _fp8_value_runs(table_row, tile + 1, ahead_end, BLOCK_N, PAGE)
                else:
                    next_runs = next_block
            else:
                block = tl.load(table_row + keys // PAGE, mask=key_valid, other=-1)
                runs_block = block
            key_valid = key_valid & (block >= 0)
            kv_offs = (
                block.to(tl.int64) * stride_cache_block
                + (keys % PAGE) * (NUM_KV_HEADS * HEAD_DIM)
                + kv_head * HEAD_DIM
            )
            # k: [BLOCK_D, BLOCK_N] (transposed), v: [BLOCK_N, BLOCK_D]
            k = tl.load(
                k_cache_ptr + kv_offs[None, :] + dims[:, None],
                mask=key_valid[None, :] & dim_valid[:, None],
                other=0.0,
            )
            if EARLY_V:  # latency-bound (few tiles per program): both loads in flight at once
                v = _values_tile(
                    v_cache_ptr, kv_offs, key_valid, table_row, tile, kv_end, kv_head, dims,
                    dim_valid, stride_cache_block, BLOCK_N, BLOCK_D, PAGE, HEAD_DIM, FP8,
                    runs_block, EARLY,
                )  # fmt: skip
            if FP8:  # e4m3 widens exactly to fp16 (and on to fp32)
                k = k.to(q.dtype)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
            allowed = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
            qk = tl.where(allowed, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if not EARLY_V:
                v = _values_tile(
                    v_cache_ptr, kv_offs, key_valid, table_row, tile, kv_end, kv_head, dims,
                    dim_valid, stride_cache_block, BLOCK_N, BLOCK_D, PAGE, HEAD_DIM, FP8,
                    runs_block, EARLY,
                )  # fmt: skip
            if FP8:  # e4m3 widens exactly to fp16
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        result = acc / l_safe[:, None]
        if FP8:
            result = result * v_scale
        store_mask = row_valid[:, None] & dim_valid[None, :]
        if NUM_SPLITS == 1:
            o_offs = (q_begin + tok).to(tl.int64)[:, None] * stride_ot + q_head[:, None] * stride_oh
            tl.store(
                out_ptr + o_offs + dims[None, :],
                result.to(out_ptr.dtype.element_ty),
                mask=store_mask,
            )
        else:
            part_row = ((q_begin + tok).to(tl.int64) * NUM_Q_HEADS + q_head) * NUM_SPLITS + split
            # A split without key tiles stores its log-sum-exp alone (-inf: the merge skips it)
            has_keys = (rows * 0 + tile_begin) < tile_end  # [BLOCK_M], one value
            tl.store(
                part_out_ptr + part_row[:, None] * BLOCK_D + dims[None, :],
                result,
                mask=store_mask & has_keys[:, None],
            )
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse_ptr + part_row, lse, mask=row_valid)


@triton.jit
def _balanced_split_tiles(  # type: ignore[no-untyped-def]
    seq_lens_ptr, num_requests, split_programs, NUM_KV_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
):  # fmt: skip
    """Key tiles per split when a step's splits are balanced: the step's tiles (all requests,
    all KV heads) over `split_programs` programs, at least `MIN_SPLIT_TILES`, and enough that
    NUM_SPLITS runs cover the longest request. Every program of the launch computes the same
    figure from `seq_lens` (a few loads of one small vector, in L2 after the first)."""
    total = 0
    longest = 0
    for first in range(0, num_requests, 128):
        req = first + tl.arange(0, 128)
        lens = tl.load(seq_lens_ptr + req, mask=req < num_requests, other=0)
        tiles = (lens + (BLOCK_N - 1)) // BLOCK_N
        total += tl.sum(tiles, 0)
        longest = tl.maximum(longest, tl.max(tiles, 0))
    per_program = (total * NUM_KV_HEADS + split_programs - 1) // split_programs
    covering = (longest + (NUM_SPLITS - 1)) // NUM_SPLITS
    return tl.maximum(tl.maximum(per_program, covering), MIN_SPLIT_TILES)


@triton.jit
def _merged_row(parts, lse):  # type: ignore[no-untyped-def]
    """One (token, query head) row's splits `parts` [splits, BLOCK_D] merged by their base-2
    log-sum-exps `lse` [splits] (-inf: a split without keys, weight 0), in float32."""
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    total = tl.sum(w, 0)
    return tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)


@triton.jit
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    base = (token * NUM_Q_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + splits, mask=split_valid, other=float("-inf"))
    dims = tl.arange(0, BLOCK_D)
    parts = tl.load(  # a split without keys (log-sum-exp -inf) stored no partial output
        part_out_ptr + (base + splits)[:, None] * BLOCK_D + dims[None, :],
        mask=(split_valid & (lse > float("-inf")))[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    merged = _merged_row(parts, lse)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


# Decode key tiles (see paged_attention): short split ranges, longer ranges, and an FP8
# cache's of each; splits above _PIPELINED_MAX_SPLITS count as short.
_SPLIT_DECODE_BLOCK_N = 32
_DECODE_BLOCK_N = 64
_FP8_DECODE_BLOCK_N = 64
_FP8_SPLIT_DECODE_BLOCK_N = 64
_PIPELINED_MAX_SPLITS = 8
# Registers per thread an FP8 cache's unsplit GPU decode with rotated queries is compiled to
# (None: the compiler's choice). Compiled for sm_90 (Triton 3.6) at 64-key tiles and 2 warps
# it needs 168 (6 programs per multiprocessor); at 128, 8 programs fit (22.5 KB of shared memory
# each) for 24 bytes of spill. A variant rotating the queries by butterflies in registers took
# 140 us at W1's shape capped so and 157 us uncapped (214 registers), the kernel rotating them
# with a Hadamard tile 151 us (bench notes, run 22); capped, this kernel took 129.3 us against
# 143.6 uncapped and 152.2 with the tile (run 23).
_FP8_DECODE_MAX_REGISTERS: int | None = 128
# Warps and pipeline stages of that launch (run 22's sweep at W1's shape, before the queries
# were rotated beforehand and the registers capped). Module constants so that a benchmark can
# time other tiles (bench section `decode-tiles`).
_FP8_DECODE_NUM_WARPS = 2
_FP8_DECODE_STAGES = 2
MAX_SPLITS = 16
# Warps per program of a decode split in many short ranges (W2's: one request, 16 splits of 72
# keys). Compiled for sm_90 by Triton 3.6 at W2's shape over an FP8 cache (64-key tiles, queries
# rotated, loads before the wait) it takes 255 registers and spills 168 bytes at 4 warps, 246
# registers and no spills at 8 (without `LOADS_BEFORE_WAIT` 248 and none at 4). At 8, W2 on an
# H100 ran level (bench notes, run 29: 287.7 decode tok/s against 287.8 and 288.3), so 4 stays.
# A module constant so that a benchmark can run the engine each way.
SHORT_SPLIT_NUM_WARPS = 4
# Decode programs one multiprocessor holds at once, by cache kind, as compiled for sm_90 by
# Triton 3.6 (16/8 heads of 128, pages of 16): the model-dtype tile takes 118 registers per
# thread x 4 warps and 38 KB of shared memory (4 by registers), the FP8 tile at its register cap
# 128 x 2 warps and 22 KB (8 by registers).
DECODE_PROGRAMS_PER_SM = {"model": 4, "fp8": 8}
# Waves of those programs a split decode aims for (`split_target_programs`). Run 23 (bench
# notes; the H200's 132 multiprocessors) set both to 1,056 programs, from 528: W1 ran 3.3%
# faster with an FP8 cache and 2.4% with bf16 (three runs each); at 90 requests of 1,260 keys,
# for one, two splits took 79.2 us against 84.8 unsplit (bf16 122.5 against 139.3). The FP8
# tile then went to two waves (2,112 programs on 132 multiprocessors; run 24, an H100: W1 with
# an FP8 cache 26,204 output tok/s against 25,107 at one wave, medians of three; bf16 at four
# waves 0.2% slower than at two, so it stays). Module constants so that a benchmark can run the
# engine at other targets.
SPLIT_WAVES = {"model": 2.0, "fp8": 2.0}
# Whether a decode whose programs are just past the target (up to a quarter more: one full
# wave and a sliver) splits in two, so that the second wave is not a few programs walking whole
# contexts. At 144 requests of 1,060 keys (1,152 programs) two splits took 102.7 us against
# 119.2 unsplit with an FP8 cache, 166.5 against 177.4 with bf16 (run 23's sweep); not yet
# timed over a workload, so off: a switch so that a benchmark can run the engine each way.
SPLIT_PAST_FULL_WAVE = False
# Whether the attention kernel reads the step's metadata, block tables and scales before its
# wait for the kernel before (programmatic dependent launch: they are inputs written before the
# step's layers, never by that kernel; see kernels/pdl.py) and each key tile's block-table
# entries a tile ahead. At decode with many splits a program's work is a chain of dependent
# loads (offsets, lengths, block table, then keys and values, twice at W2's two tiles per
# split); this leaves the keys and values after the wait. On an H100 (bench notes, run 25),
# with the rotary kernel's switch: W2 with FP8 weights and KV 279.1 decode tok/s against
# 273.0, W1 with an FP8 cache 27,422.7 output tok/s against 26,955.0, bf16 W1 +0.7% and W2
# +0.7% (medians of two; the same tokens); its attention kernel took 10.0 us a launch in W2's
# profile against 12.9. A switch so that a benchmark can run the engine each way.
LOADS_BEFORE_WAIT = True
# Whether split decodes of several requests balance their keys (`paged_attention`'s
# `split_programs`): every split owns the same run of key tiles, the step's tiles over
# `BALANCED_WAVES` waves of programs, so a long request takes more splits than a short one and
# the step does not wait on its longest requests' programs. Proportional splits (each request's
# keys in `num_splits` runs) leave an FP8 step of one wave as long as its longest context: in W1
# contexts run from 100 to 1,024 keys past the step, so the longest is 1.5x the mean mid-run.
# Off: on an H100 (bench notes, run 24) W1 ran slower with it, FP8 -1.9% and bf16 -0.6%
# (medians of three), and the balanced FP8 decode was slower at 6 of 7 of W1's steps; a switch
# so that a benchmark can run the engine each way.
BALANCE_SPLITS = False
# Waves per cache kind: the best of 2, 3 and 4 for both in the list-scheduling model of W1
# (`python -m davit_tools.bench.split_model`: FP8 -14.6%, bf16 -5.5% against the engine's
# proportional splits; bench notes, between runs 23 and 24).
BALANCED_WAVES = {"model": 3.0, "fp8": 3.0}
# Grid splits per request of a balanced decode: this many times the target's programs over the
# step's (room for requests longer than the mean; a longer one lengthens every run instead).
_BALANCED_GRID_SLACK = 2
# The fewest key tiles a balanced split owns (below, the program's fixed cost dominates).
_MIN_BALANCED_SPLIT_TILES = 2


def _cache_kind(fp8: bool) -> str:
    return "fp8" if fp8 else "model"


def _programs_in_waves(waves: dict[str, float], device: torch.device, fp8: bool) -> int:
    """`waves[kind]` waves of the decode tile's programs (`DECODE_PROGRAMS_PER_SM` on each of
    `device`'s multiprocessors), at least one."""
    kind = _cache_kind(fp8)
    return max(1, round(waves[kind] * DECODE_PROGRAMS_PER_SM[kind] * multiprocessors(device)))


def split_target_programs(device: torch.device, fp8: bool = False) -> int:
    """Programs a split decode aims for on `device`: `SPLIT_WAVES` waves of the decode tile's
    programs."""
    return _programs_in_waves(SPLIT_WAVES, device, fp8)


def balanced_split_programs(device: torch.device, fp8: bool = False) -> int:
    """Programs a balanced split decode spreads the step's key tiles over (`BALANCED_WAVES`)."""
    return _programs_in_waves(BALANCED_WAVES, device, fp8)


def default_num_splits(
    num_requests: int,
    num_kv_heads: int,
    max_seq_len: int,
    device: torch.device,
    fp8: bool = False,
) -> int:
    """Key-range splits for a decode step (`fp8`: over an FP8 cache, whose tile fits more
    programs per multiprocessor): enough programs for the target (`split_target_programs`), at
    most one split per 32-key tile (and two just past the target with `SPLIT_PAST_FULL_WAVE`;
    with `BALANCE_SPLITS` and several requests, room for balanced runs of key tiles). Splits
    past the keys a step has do no work, so a CUDA graph captured for `max_model_len` keeps
    short contexts cheap while long ones spread out. Off a GPU (Triton's interpreter runs one
    program after another) splitting only adds the merge pass: one split."""
    if device.type != "cuda":
        return 1
    programs = max(num_requests * num_kv_heads, 1)
    target = split_target_programs(device, fp8)
    if BALANCE_SPLITS and num_requests > 1:
        wanted = math.ceil(_BALANCED_GRID_SLACK * balanced_split_programs(device, fp8) / programs)
    else:
        wanted = max(1, math.ceil(target / programs))
        if SPLIT_PAST_FULL_WAVE and target < programs <= target * 5 // 4:
            wanted = 2
    return max(1, min(MAX_SPLITS, wanted, math.ceil(max_seq_len / _SPLIT_DECODE_BLOCK_N)))


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], contiguous
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    max_query_len: int,
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,  # [2, Hkv] float32: needed for an FP8 cache
    queries_rotated: bool = False,
    split_programs: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each request's new tokens over its paged keys and values.

    `split_programs` (with `num_splits > 1`): balanced splits. Every split owns the same run of
    key tiles, the step's tiles (all requests and KV heads) over about this many programs, at
    least enough that `num_splits` runs cover the longest request; a request uses as many of
    its splits as its keys fill. None: balanced with `balanced_split_programs` where
    `BALANCE_SPLITS` is on, the step has several requests and runs on a GPU; otherwise each
    request's keys in `num_splits` equal runs.

    `queries_rotated`: `q` is already `q @ H` (an FP8 cache whose keys are stored rotated;
    `kernels.layer_ops.qk_norm_rope(..., rotate_queries=True)` makes it), so the kernel does
    not rotate it, nor hold the Hadamard tile that rotating takes.

    `num_splits > 1` splits every request's key range (use it for decode at small batch); the
    launch shape depends only on the batch size, `max_query_len` and `num_splits`, so the call is
    safe to capture in a CUDA graph.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, page, num_kv_heads, _ = kv_cache.shape
    num_requests = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_requests == 0:
        return out
    assert q.stride(2) == 1 and kv_cache.is_contiguous() and block_tables.stride(1) == 1
    fp8 = is_fp8(kv_cache.dtype)
    if fp8:
        assert kv_scale is not None and tuple(kv_scale.shape) == (2, num_kv_heads)
        assert kv_scale.dtype == torch.float32 and kv_scale.is_contiguous()
    rotate = fp8 and rotates_keys(head_dim)
    if queries_rotated and not rotate:
        raise ValueError(
            "queries_rotated: only an FP8 cache with a head dim that is a power of two in "
            f"[16, 256] stores rotated keys (cache {kv_cache.dtype}, head dim {head_dim})"
        )
    if split_programs is not None and split_programs < 1:
        raise ValueError(f"split_programs must be at least 1 (got {split_programs})")
    if (
        split_programs is None
        and BALANCE_SPLITS
        and num_splits > 1
        and num_requests > 1
        and q.device.type == "cuda"
    ):
        split_programs = balanced_split_programs(q.device, fp8)
    balanced = num_splits > 1 and split_programs is not None
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    is_decode = max_query_len == 1
    block_m = max(16 if is_decode else 64, group_pad)
    block_q = block_m // group_pad
    # Decode tiles measured on an H200 (16/8 heads of 128, pages of 16; bench notes run 22).
    # Few splits (each still hundreds of keys) take the unsplit tiles, pipelined: at 64
    # requests of 1,500 keys in 2 splits bf16 took 104 us with them against 156 us with the
    # short-split tiles, FP8 82 against 88. Many splits (short ranges, latency-bound) take no
    # pipelining: at 1 request of 1,152 keys in 16 splits bf16 7.7 us against 7.9, FP8 8.6
    # with 64-key tiles against 9.3 with 32. An FP8 cache's longer ranges take 64-key tiles and
    # 2 warps: at 256 requests of 840 keys 152 us against 159 us with 128-key tiles and 4
    # warps unpipelined (bf16: 224 us).
    num_warps = 4
    limits: dict[str, int] = {}
    if is_decode and num_splits > _PIPELINED_MAX_SPLITS:
        block_n, num_stages = (_FP8_SPLIT_DECODE_BLOCK_N if fp8 else _SPLIT_DECODE_BLOCK_N), 1
        num_warps = SHORT_SPLIT_NUM_WARPS
    elif is_decode and fp8 and q.device.type == "cuda":
        block_n, num_stages = _FP8_DECODE_BLOCK_N, _FP8_DECODE_STAGES
        num_warps = _FP8_DECODE_NUM_WARPS
        if queries_rotated and _FP8_DECODE_MAX_REGISTERS is not None:
            limits["maxnreg"] = _FP8_DECODE_MAX_REGISTERS
    elif is_decode:
        block_n, num_stages = _DECODE_BLOCK_N, 2
    else:
        block_n, num_stages = 64, 2
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_q_tiles = triton.cdiv(max_query_len, block_q)
    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_q_heads, num_splits, block_d), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused by the kernel
    grid = (num_requests * num_q_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q,
        kv_cache[0],
        kv_cache[1],
        out,
        part_out,
        part_lse,
        block_tables,
        seq_lens,
        query_start_loc,
        kv_scale if fp8 else seq_lens,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache.stride(1),
        num_q_tiles,
        num_requests,
        split_programs if balanced else 1,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE=page,
        NUM_SPLITS=num_splits,
        BALANCED=balanced,
        MIN_SPLIT_TILES=_MIN_BALANCED_SPLIT_TILES,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        EARLY_V=is_decode and num_splits > 1,
        FP8=fp8,
        ROTATE=rotate,
        Q_ROTATED=queries_rotated,
        F16_DOT=fp8 and q.dtype != torch.float32,
        EARLY=LOADS_BEFORE_WAIT,
        num_warps=num_warps,
        num_stages=num_stages,
        **limits,
        **pdl_launch(q.device),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            **pdl_launch(q.device),
        )
    return out


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `paged_attention`, one request at a time, in float64 (an FP8 cache
    read through its per-head scales)."""
    num_tokens, num_q_heads, head_dim = q.shape
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for req, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = qsl[req], qsl[req + 1]
        q_len = q_end - q_begin
        if q_len == 0 or seq_len == 0:
            continue
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[req, positions // page].long()
        keys = kv_cache[0, blocks, positions % page].double()  # [S, Hkv, D]
        if is_fp8(kv_cache.dtype):
            assert kv_scale is not None
            # values stored key-minor: [blocks, Hkv, D, page]
            values = fp8_values_by_key(kv_cache)[blocks, :, :, positions % page].double()
            keys = keys * kv_scale[0].double()[None, :, None]
            values = values * kv_scale[1].double()[None, :, None]
            if rotates_keys(head_dim):  # stored as k @ H: back with H^T / D
                rotation = hadamard(head_dim, keys.device, torch.float64)
                keys = keys @ rotation.t() / head_dim
        else:
            values = kv_cache[1, blocks, positions % page].double()
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        queries = q[q_begin:q_end].double()  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", queries, keys) * scale
        q_pos = (seq_len - q_len) + torch.arange(q_len, device=q.device)
        mask = positions[None, :] <= q_pos[:, None]  # [L, S]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hls,shd->lhd", probs, values).to(q.dtype)
    return out
