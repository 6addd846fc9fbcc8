"""Sampling on the GPU: greedy, temperature, top-k, top-p, min-p and per-request seeds.

Penalties are applied to the logits beforehand (kernels/penalties.py).

Randomness comes from a counter-based hash of (request seed, position, token id), so a request's
draw depends only on its own seed and position, never on the batch it shares, on how the
vocabulary is split over programs, or on a generator state that the host would have to advance;
nothing here synchronises with the host. A random draw is a Gumbel-max race: the kept token with
the largest `logit / T + Gumbel(hash)` wins, which samples exactly from the softmax restricted to
the kept tokens, without a sort or a normalised probability vector.

Filters, in this order, on the temperature-scaled logits `y = x * (1 / T)`: top-k keeps the
tokens at least as large as the k-th largest (ties with it stay in), top-p keeps the smallest top
set whose probability mass within the top-k set reaches p, min-p keeps the tokens whose
probability is at least min_p times the largest.

Every row is split over programs of SPLIT tokens. Greedy and plain-temperature rows finish in
two launches: each program races its slice, a per-row merge picks the winner. Rows with a filter
(top-k, top-p or min-p) need thresholds that depend on the whole row; they are found without a
sort and without a pass per bisection step:

1. The split pass also records each slice's maximum, minimum and softmax mass (relative to the
   slice maximum); the merge turns them into the row maximum and the row's total mass.
2. Search passes (SEARCH_LEVELS launches; a row stops searching once it can): every program
   counts the tokens and sums the mass at and above EDGES thresholds of its row; the last
   program of the row to finish adds the slices up and keeps the interval between neighbouring
   thresholds that holds the top-k threshold (rows with top-k) or the top-p threshold. The
   first pass spreads its thresholds below the maximum, the next ones split the kept interval
   evenly. The search stops as soon as the top set down to the interval's bottom, or for
   top-p alone the interval itself, holds at most CANDIDATE_CAP tokens.
3. The gather pass copies those tokens into a per-row candidate list; for an interval, it also
   races the tokens above it (all kept) and sums their mass where they lie.
4. The draw (one program per row) finds the exact thresholds among the candidates (bisection
   on the float's bit pattern, so ties and the k-th value are exact), races the kept
   candidates against the slices' winners and writes the token.

A min-p threshold is known from the maximum alone, so a min-p-only row (or one whose min-p
threshold lies above the search's interval) skips to the gather pass with it. A row the search
cannot narrow enough (top-k above CANDIDATE_CAP, many equal logits) or whose candidate sums
disagree with the search's by rounding takes the whole-row path in the draw: one program
bisects on the value over the full row, each step one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_SPLIT = 4096  # vocabulary slice per program
_SUB = 256  # tokens per step inside a search program
_GATHER_SUB = 1024  # tokens per step inside a gather program
_EDGES = 8  # thresholds per search pass
_SEARCH_DEPTH = 16.0  # the first pass's thresholds reach this far below the scaled maximum
_SEARCH_LEVELS = 4  # search passes launched when a row has a filter
_CANDIDATE_CAP = 8192  # tokens a row may carry into its exact threshold search
_BISECT_STEPS = 32  # whole-row path
_SEARCH_SPAN = 1000.0  # whole-row path: scaled-logit distance below the maximum where it starts

# What a filtered row does next (plan column MODE); FILTER_PATHS names them.
_MODE_NONE = tl.constexpr(0)
_MODE_SEARCH = tl.constexpr(1)
_MODE_GATHER = tl.constexpr(2)
_MODE_THRESHOLD = tl.constexpr(3)
_MODE_WHOLE_ROW = tl.constexpr(4)
FILTER_PATHS = ("unfiltered", "search", "candidates", "threshold", "whole-row")
# Float columns of a row's plan.
_P_MAX = tl.constexpr(0)  # scaled maximum m
_P_MASS = tl.constexpr(1)  # total mass: sum of exp(y - m) over the row
_P_LOW = tl.constexpr(2)  # interval bottom (gather: candidates are y >= LOW and y < HIGH)
_P_HIGH = tl.constexpr(3)  # interval top (+inf: none above)
_P_COUNT_HIGH = tl.constexpr(4)  # tokens with y >= HIGH
_P_MASS_HIGH = tl.constexpr(5)  # their mass
_P_COUNT_LOW = tl.constexpr(6)  # tokens with y >= LOW
_P_MASS_LOW = tl.constexpr(7)  # their mass
_PLAN_FLOATS = tl.constexpr(8)
# Int columns.
_P_MODE = tl.constexpr(0)
_P_GREEDY = tl.constexpr(1)  # argmax: drawn when every kept score is -inf
_P_PASSES = tl.constexpr(2)  # search passes the row has used
_P_DONE = tl.constexpr(3)  # programs of the row that finished the current pass
_PLAN_INTS = tl.constexpr(4)
_NO_KEY = tl.constexpr(-2147483647)  # below the key of every float but NaN


@triton.jit
def _mix32(x):  # type: ignore[no-untyped-def]
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _gumbel(seed, pos, idx):  # type: ignore[no-untyped-def]
    h = _mix32(seed ^ (pos * 0x9E3779B1))
    h = _mix32(h ^ (idx * 0x85EBCA77))
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _reciprocal(temperature):  # type: ignore[no-untyped-def]
    # Rounded like the host's float32 1 / T, so y = x * (1 / T) matches the reference.
    return tl.math.div_rn(1.0, temperature)


@triton.jit
def _key(y):  # type: ignore[no-untyped-def]
    # An int32 that orders like the float (-0.0 counts as 0.0; NaN is not expected).
    bits = tl.where(y == 0.0, 0.0, y).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _min_p_threshold(m, min_p):  # type: ignore[no-untyped-def]
    return tl.where(min_p > 0.0, m + tl.log(tl.where(min_p > 0.0, min_p, 1.0)), float("-inf"))


@triton.jit
def _is_filtered(temperature, top_k, top_p, min_p, vocab_size):  # type: ignore[no-untyped-def]
    # A random draw with top-k, top-p or min-p: the rows the plain split path leaves out.
    random = (temperature > 0.0) & (top_k != 1)
    return random & (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0) | (min_p > 0.0))


@triton.jit
def _sample_split_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    part_score_ptr,
    part_index_ptr,
    part_mass_ptr,
    part_low_ptr,
    row_slot_ptr,
    seq_lens_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    stride_logits,
    stride_params,
    vocab_size,
    num_splits,
    SPLIT: tl.constexpr,
    FILTERS: tl.constexpr,
):
    # One program per (row, slice of SPLIT tokens): the slice's best greedy or Gumbel score;
    # for a filtered row, the slice's largest logit (and its index), smallest scaled logit and
    # softmax mass relative to its largest scaled logit.
    row = tl.program_id(0)
    split = tl.program_id(1)
    param = tl.load(row_slot_ptr + row).to(tl.int64) * stride_params
    temperature = tl.load(temperature_ptr + param)
    top_k = tl.load(top_k_ptr + param)
    idx = split * SPLIT + tl.arange(0, SPLIT)
    valid = idx < vocab_size
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits
    x = tl.load(row_ptr + idx, mask=valid, other=float("-inf"))
    part = row * num_splits + split
    filtered = False
    if FILTERS:
        top_p = tl.load(top_p_ptr + param)
        filtered = _is_filtered(temperature, top_k, top_p, tl.load(min_p_ptr + param), vocab_size)
    if filtered:
        best = tl.max(x, 0)
        best_idx = tl.min(tl.where(x == best, idx, vocab_size), 0)
        inv_t = _reciprocal(temperature)
        y = x * inv_t
        top = best * inv_t
        finite = top > float("-inf")  # a slice of -inf logits has no mass
        mass = tl.sum(tl.exp(y - tl.where(finite, top, 0.0)), 0)
        tl.store(part_mass_ptr + part, tl.where(finite, mass, 0.0))
        tl.store(part_low_ptr + part, tl.min(tl.where(valid, y, float("inf")), 0))
    else:
        if (temperature > 0.0) & (top_k != 1):
            seed = tl.load(seed_ptr + param).to(tl.uint32)
            pos = tl.load(seq_lens_ptr + row).to(tl.uint32)
            x = x * _reciprocal(temperature) + _gumbel(seed, pos, idx.to(tl.uint32))
        best = tl.max(x, 0)
        best_idx = tl.min(tl.where(x == best, idx, vocab_size), 0)
    tl.store(part_score_ptr + part, best)
    tl.store(part_index_ptr + part, best_idx)


@triton.jit
def _sample_merge_kernel(  # type: ignore[no-untyped-def]
    part_score_ptr,
    part_index_ptr,
    part_mass_ptr,
    part_low_ptr,
    plan_ptr,
    plan_int_ptr,
    edges_ptr,
    cand_count_ptr,
    out_ptr,
    row_slot_ptr,
    seq_lens_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    needs_sample_ptr,
    token_table_ptr,
    stride_token_table,
    stride_params,
    vocab_size,
    num_splits,
    max_model_len,
    COMMIT: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    FILTERS: tl.constexpr,
    EDGES: tl.constexpr,
    SEARCH_DEPTH: tl.constexpr,
    CANDIDATE_CAP: tl.constexpr,
):
    # One program per row: the winner of an unfiltered row; a filtered row's first plan.
    row = tl.program_id(0)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    param = slot * stride_params
    temperature = tl.load(temperature_ptr + param)
    top_k = tl.load(top_k_ptr + param)
    top_p = tl.load(top_p_ptr + param)
    min_p = tl.load(min_p_ptr + param)
    filtered = _is_filtered(temperature, top_k, top_p, min_p, vocab_size)
    splits = tl.arange(0, SPLITS_PAD)
    in_row = splits < num_splits
    part = row * num_splits + splits
    score = tl.load(part_score_ptr + part, mask=in_row, other=float("-inf"))
    index = tl.load(part_index_ptr + part, mask=in_row, other=vocab_size)
    best = tl.max(score, 0)
    token = tl.min(tl.where(score == best, index, vocab_size), 0)
    if not filtered:
        tl.store(out_ptr + row, token.to(tl.int64))
        if COMMIT:
            pos = tl.load(seq_lens_ptr + row)
            keep = (tl.load(needs_sample_ptr + row) != 0) & (pos < max_model_len)
            dst = token_table_ptr + slot * stride_token_table + pos
            tl.store(dst, token.to(tl.int32), mask=keep)
    if FILTERS:
        plan = plan_ptr + row * _PLAN_FLOATS
        plan_int = plan_int_ptr + row * _PLAN_INTS
        if filtered:
            inv_t = _reciprocal(temperature)
            m = best * inv_t  # the scaled maximum: scaling keeps the order
            tops = score * inv_t
            mass = tl.load(part_mass_ptr + part, mask=in_row, other=0.0)
            total = tl.sum(tl.where(tops > float("-inf"), mass * tl.exp(tops - m), 0.0), 0)
            low = tl.min(tl.load(part_low_ptr + part, mask=in_row, other=float("inf")), 0)
            top_k_on = (top_k > 0) & (top_k < vocab_size)
            min_p_only = ((top_k <= 0) | (top_k >= vocab_size)) & (top_p >= 1.0)
            t_min = _min_p_threshold(m, min_p)
            mode = tl.where(min_p_only, _MODE_THRESHOLD, _MODE_SEARCH)
            # A top set larger than the candidate list can never be gathered.
            mode = tl.where(top_k_on & (top_k > CANDIDATE_CAP), _MODE_WHOLE_ROW, mode)
            mode = tl.where(m > float("-inf"), mode, _MODE_WHOLE_ROW)
            tl.store(plan + _P_MAX, m)
            tl.store(plan + _P_MASS, total)
            tl.store(plan + _P_LOW, tl.where(min_p_only, t_min, low))
            tl.store(plan + _P_HIGH, tl.where(min_p_only, t_min, float("inf")))
            tl.store(plan + _P_COUNT_HIGH, 0.0)
            tl.store(plan + _P_MASS_HIGH, 0.0)
            tl.store(plan + _P_COUNT_LOW, vocab_size * 1.0)
            tl.store(plan + _P_MASS_LOW, total)
            tl.store(plan_int + _P_MODE, mode)
            tl.store(plan_int + _P_GREEDY, token)
            tl.store(plan_int + _P_PASSES, 0)
            tl.store(plan_int + _P_DONE, 0)
            # First search: thresholds spread quadratically below the maximum (dense near it).
            j = tl.arange(0, EDGES)
            depth = (j + 1).to(tl.float32) / EDGES
            tl.store(edges_ptr + row * EDGES + j, m - SEARCH_DEPTH * depth * depth)
            tl.store(cand_count_ptr + row, 0)
        else:
            tl.store(plan_int + _P_MODE, _MODE_NONE)
            tl.store(plan_int + _P_PASSES, 0)


@triton.jit
def _filter_search_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    part_count_ptr,
    part_edge_mass_ptr,
    plan_ptr,
    plan_int_ptr,
    edges_ptr,
    row_slot_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    stride_logits,
    stride_params,
    vocab_size,
    num_splits,
    SPLIT: tl.constexpr,
    SUB: tl.constexpr,
    EDGES: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SEARCH_LEVELS: tl.constexpr,
    CANDIDATE_CAP: tl.constexpr,
):
    # One program per (row, slice): the slice's token count and mass at and above each of the
    # row's thresholds, counting only the tokens below the interval top (those above it were
    # counted by an earlier pass). The row's last program plans the next step.
    row = tl.program_id(0)
    split = tl.program_id(1)
    plan = plan_ptr + row * _PLAN_FLOATS
    plan_int = plan_int_ptr + row * _PLAN_INTS
    if tl.load(plan_int + _P_MODE) == _MODE_SEARCH:
        param = tl.load(row_slot_ptr + row).to(tl.int64) * stride_params
        inv_t = _reciprocal(tl.load(temperature_ptr + param))
        m = tl.load(plan + _P_MAX)
        high = tl.load(plan + _P_HIGH)
        j = tl.arange(0, EDGES)
        edges = tl.load(edges_ptr + row * EDGES + j)
        lowest = tl.load(edges_ptr + row * EDGES + EDGES - 1)
        count = tl.zeros([SUB, EDGES], tl.float32)
        mass = tl.zeros([SUB, EDGES], tl.float32)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_logits
        for start in range(0, SPLIT, SUB):
            idx = split * SPLIT + start + tl.arange(0, SUB)
            y = tl.load(row_ptr + idx, mask=idx < vocab_size, other=float("-inf")) * inv_t
            inside = (y >= lowest) & (y < high)
            # Most steps of a peaked row hold no token near the top: skip their arithmetic.
            if tl.max(inside.to(tl.int32), 0) > 0:
                above = inside[:, None] & (y[:, None] >= edges[None, :])
                count += above.to(tl.float32)
                mass += tl.where(above, tl.exp(y - m)[:, None], 0.0)
        part = (row * num_splits + split) * EDGES + j
        tl.store(part_count_ptr + part, tl.sum(count, 0))
        tl.store(part_edge_mass_ptr + part, tl.sum(mass, 0))
        tl.debug_barrier()  # every thread's stores precede the release below
        if tl.atomic_add(plan_int + _P_DONE, 1) == num_splits - 1:
            tl.store(plan_int + _P_DONE, 0)
            param_k = tl.load(top_k_ptr + param)
            _plan_next(
                plan,
                plan_int,
                edges_ptr,
                part_count_ptr,
                part_edge_mass_ptr,
                row,
                edges,
                m,
                high,
                param_k,
                tl.load(top_p_ptr + param),
                tl.load(min_p_ptr + param),
                vocab_size,
                num_splits,
                EDGES,
                SPLITS_PAD,
                SEARCH_LEVELS,
                CANDIDATE_CAP,
            )


@triton.jit
def _plan_next(  # type: ignore[no-untyped-def]
    plan,
    plan_int,
    edges_ptr,
    part_count_ptr,
    part_edge_mass_ptr,
    row,
    edges,
    m,
    high,
    top_k,
    top_p,
    min_p,
    vocab_size,
    num_splits,
    EDGES: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SEARCH_LEVELS: tl.constexpr,
    CANDIDATE_CAP: tl.constexpr,
):
    # The row's counts and masses at and above each threshold (the interval top's included);
    # keep the interval between neighbouring thresholds that holds the top-k threshold (rows
    # with top-k) or the top-p threshold (top-p only), then gather it, search it again, or give
    # up. The slices' sums are read past L1: other programs wrote them.
    j = tl.arange(0, EDGES)
    splits = tl.arange(0, SPLITS_PAD)
    part = (row * num_splits + splits[:, None]) * EDGES + j[None, :]
    in_row = (splits < num_splits)[:, None]
    slice_count = tl.load(part_count_ptr + part, mask=in_row, other=0.0, cache_modifier=".cg")
    slice_mass = tl.load(part_edge_mass_ptr + part, mask=in_row, other=0.0, cache_modifier=".cg")
    count_high = tl.load(plan + _P_COUNT_HIGH)
    mass_high = tl.load(plan + _P_MASS_HIGH)
    count = count_high + tl.sum(slice_count, 0)  # [EDGES]
    mass = mass_high + tl.sum(slice_mass, 0)
    top_k_on = (top_k > 0) & (top_k < vocab_size)
    target = top_p * tl.load(plan + _P_MASS)
    holds = tl.where(top_k_on, count >= top_k, mass >= target)
    at = tl.min(tl.where(holds, j, EDGES), 0)  # EDGES: only the interval bottom holds
    pick = j == at
    pick_above = j == at - 1
    bottom = tl.where(at == EDGES, tl.load(plan + _P_LOW), tl.sum(tl.where(pick, edges, 0.0), 0))
    count_bottom = tl.where(
        at == EDGES, tl.load(plan + _P_COUNT_LOW), tl.sum(tl.where(pick, count, 0.0), 0)
    )
    mass_bottom = tl.where(
        at == EDGES, tl.load(plan + _P_MASS_LOW), tl.sum(tl.where(pick, mass, 0.0), 0)
    )
    top = tl.where(at == 0, high, tl.sum(tl.where(pick_above, edges, 0.0), 0))
    count_top = tl.where(at == 0, count_high, tl.sum(tl.where(pick_above, count, 0.0), 0))
    mass_top = tl.where(at == 0, mass_high, tl.sum(tl.where(pick_above, mass, 0.0), 0))
    # Gather the whole top set (down to `bottom`) when it fits: its race is then a race over
    # the list. A top-p-only row may instead gather the interval alone; the gather pass races
    # the tokens above it where they lie.
    top_set_fits = count_bottom <= CANDIDATE_CAP
    top_k_off = (top_k <= 0) | (top_k >= vocab_size)
    interval_fits = top_k_off & (count_bottom - count_top <= CANDIDATE_CAP)
    fits = top_set_fits | interval_fits
    passes = tl.load(plan_int + _P_PASSES) + 1
    deeper = (passes < SEARCH_LEVELS) & (bottom > float("-inf"))
    mode = tl.where(fits, _MODE_GATHER, tl.where(deeper, _MODE_SEARCH, _MODE_WHOLE_ROW))
    # Both thresholds lie below `top` unless top-k and top-p are combined: a min-p threshold
    # at or above it decides alone.
    t_min = _min_p_threshold(m, min_p)
    single = (top_k <= 0) | (top_k >= vocab_size) | (top_p >= 1.0)
    by_min_p = single & (t_min >= top)
    mode = tl.where(by_min_p, _MODE_THRESHOLD, mode)
    next_high = tl.where(top_set_fits & (mode == _MODE_GATHER), float("inf"), top)
    tl.store(plan + _P_LOW, tl.where(by_min_p, t_min, bottom))
    tl.store(plan + _P_HIGH, tl.where(by_min_p, t_min, next_high))
    tl.store(plan + _P_COUNT_HIGH, count_top)
    tl.store(plan + _P_MASS_HIGH, mass_top)
    tl.store(plan + _P_COUNT_LOW, count_bottom)
    tl.store(plan + _P_MASS_LOW, mass_bottom)
    tl.store(plan_int + _P_MODE, mode)
    tl.store(plan_int + _P_PASSES, passes)
    # The next search splits [bottom, top) evenly (tokens never exceed the maximum).
    top_used = tl.minimum(top, m)
    step = (top_used - bottom) / (EDGES + 1)
    tl.store(edges_ptr + row * EDGES + j, top_used - (j + 1).to(tl.float32) * step)


@triton.jit
def _filter_gather_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    part_score_ptr,
    part_index_ptr,
    part_mass_ptr,
    plan_ptr,
    plan_int_ptr,
    cand_value_ptr,
    cand_index_ptr,
    cand_count_ptr,
    row_slot_ptr,
    seq_lens_ptr,
    temperature_ptr,
    seed_ptr,
    stride_logits,
    stride_params,
    vocab_size,
    num_splits,
    SPLIT: tl.constexpr,
    SUB: tl.constexpr,
    CANDIDATE_CAP: tl.constexpr,
):
    # One program per (row, slice): race the slice's tokens at or above the interval top and
    # sum their mass; append the interval's tokens to the row's candidate list. SUB tokens a
    # step keep the registers (and so the programs per SM) of a streaming pass.
    row = tl.program_id(0)
    split = tl.program_id(1)
    plan = plan_ptr + row * _PLAN_FLOATS
    mode = tl.load(plan_int_ptr + row * _PLAN_INTS + _P_MODE)
    if (mode == _MODE_GATHER) | (mode == _MODE_THRESHOLD):
        param = tl.load(row_slot_ptr + row).to(tl.int64) * stride_params
        inv_t = _reciprocal(tl.load(temperature_ptr + param))
        seed = tl.load(seed_ptr + param).to(tl.uint32)
        pos = tl.load(seq_lens_ptr + row).to(tl.uint32)
        m = tl.load(plan + _P_MAX)
        low = tl.load(plan + _P_LOW)
        high = tl.load(plan + _P_HIGH)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_logits
        mass = 0.0
        best = float("-inf")
        best_idx = vocab_size
        for start in range(0, SPLIT, SUB):
            idx = split * SPLIT + start + tl.arange(0, SUB)
            valid = idx < vocab_size
            y = tl.load(row_ptr + idx, mask=valid, other=float("-inf")) * inv_t
            # All kept: a row whose min-p threshold reaches HIGH was moved to the threshold
            # mode, where HIGH is that threshold.
            above = valid & (y >= high)
            if tl.max(above.to(tl.int32), 0) > 0:
                mass += tl.sum(tl.where(above, tl.exp(y - m), 0.0), 0)
                g = _gumbel(seed, pos, idx.to(tl.uint32))
                score = tl.where(above, y + g, float("-inf"))
                step_best = tl.max(score, 0)
                step_idx = tl.min(tl.where(score == step_best, idx, vocab_size), 0)
                better = step_best > best  # on a tie the earlier step's index is lower
                best_idx = tl.where(better, step_idx, best_idx)
                best = tl.where(better, step_best, best)
            listed = valid & (y >= low) & (y < high)
            num_listed = tl.sum(listed.to(tl.int32), 0)
            if num_listed > 0:
                first = tl.atomic_add(cand_count_ptr + row, num_listed)
                at = first + tl.cumsum(listed.to(tl.int32), 0) - 1
                fits = listed & (at < CANDIDATE_CAP)
                dst = row.to(tl.int64) * CANDIDATE_CAP + at
                tl.store(cand_value_ptr + dst, y, mask=fits)
                tl.store(cand_index_ptr + dst, idx, mask=fits)
        part = row * num_splits + split
        tl.store(part_score_ptr + part, best)
        tl.store(part_index_ptr + part, best_idx)
        tl.store(part_mass_ptr + part, mass)


@triton.jit
def _filter_draw_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    out_ptr,
    part_score_ptr,
    part_index_ptr,
    part_mass_ptr,
    plan_ptr,
    plan_int_ptr,
    cand_value_ptr,
    cand_index_ptr,
    cand_count_ptr,
    row_slot_ptr,
    seq_lens_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    needs_sample_ptr,
    token_table_ptr,
    stride_logits,
    stride_token_table,
    stride_params,
    vocab_size,
    num_splits,
    max_model_len,
    COMMIT: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CANDIDATE_CAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BISECT_STEPS: tl.constexpr,
    SEARCH_SPAN: tl.constexpr,
):
    # One program per filtered row: the token from the candidate list and the slices'
    # winners, or from the whole-row path when the plan or the list cannot decide.
    row = tl.program_id(0)
    plan = plan_ptr + row * _PLAN_FLOATS
    plan_int = plan_int_ptr + row * _PLAN_INTS
    mode = tl.load(plan_int + _P_MODE)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    param = slot * stride_params
    pos = tl.load(seq_lens_ptr + row)
    top_k = tl.load(top_k_ptr + param)
    top_p = tl.load(top_p_ptr + param)
    min_p = tl.load(min_p_ptr + param)
    seed = tl.load(seed_ptr + param).to(tl.uint32)
    whole_row = (mode == _MODE_WHOLE_ROW).to(tl.int32)
    if (mode == _MODE_GATHER) | (mode == _MODE_THRESHOLD):
        whole_row = _draw_from_candidates(
            plan,
            plan_int,
            mode,
            row,
            slot,
            pos,
            top_k,
            top_p,
            min_p,
            seed,
            part_score_ptr,
            part_index_ptr,
            part_mass_ptr,
            cand_value_ptr,
            cand_index_ptr,
            cand_count_ptr,
            out_ptr,
            needs_sample_ptr,
            token_table_ptr,
            stride_token_table,
            vocab_size,
            num_splits,
            max_model_len,
            COMMIT,
            SPLITS_PAD,
            CANDIDATE_CAP,
        )
    if whole_row != 0:
        tl.store(plan_int + _P_MODE, _MODE_WHOLE_ROW)
        _sample_filtered_row(
            logits_ptr,
            out_ptr,
            needs_sample_ptr,
            token_table_ptr,
            row,
            slot,
            pos,
            tl.load(temperature_ptr + param),
            top_k,
            top_p,
            min_p,
            seed,
            stride_logits,
            stride_token_table,
            vocab_size,
            max_model_len,
            COMMIT,
            BLOCK_V,
            BISECT_STEPS,
            SEARCH_SPAN,
        )


@triton.jit
def _kth_key(key, listed, k):  # type: ignore[no-untyped-def]
    # The largest key K with at least k listed keys >= K: the k-th largest listed key.
    lo = tl.min(tl.where(listed, key, 2147483647), 0).to(tl.int64)
    hi = tl.max(tl.where(listed, key, -2147483647), 0).to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if tl.sum((listed & (key >= mid.to(tl.int32))).to(tl.int32), 0) >= k:
            lo = mid
        else:
            hi = mid - 1
    return lo.to(tl.int32)


@triton.jit
def _mass_key(key, kept, weight, mass_above, target):  # type: ignore[no-untyped-def]
    # The largest key K whose kept keys >= K, with `mass_above`, weigh at least `target`.
    lo = tl.min(tl.where(kept, key, 2147483647), 0).to(tl.int64)
    hi = tl.max(tl.where(kept, key, -2147483647), 0).to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        heavy = kept & (key >= mid.to(tl.int32))
        if mass_above + tl.sum(tl.where(heavy, weight, 0.0), 0) >= target:
            lo = mid
        else:
            hi = mid - 1
    return lo.to(tl.int32)


@triton.jit
def _draw_from_candidates(  # type: ignore[no-untyped-def]
    plan,
    plan_int,
    mode,
    row,
    slot,
    pos,
    top_k,
    top_p,
    min_p,
    seed,
    part_score_ptr,
    part_index_ptr,
    part_mass_ptr,
    cand_value_ptr,
    cand_index_ptr,
    cand_count_ptr,
    out_ptr,
    needs_sample_ptr,
    token_table_ptr,
    stride_token_table,
    vocab_size,
    num_splits,
    max_model_len,
    COMMIT: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CANDIDATE_CAP: tl.constexpr,
):
    # Exact thresholds among the candidates, their race against the slices' winners, the
    # token's store. Returns 1 when the candidates cannot decide (the whole-row path must).
    splits = tl.arange(0, SPLITS_PAD)
    in_row = splits < num_splits
    part = row * num_splits + splits
    score = tl.load(part_score_ptr + part, mask=in_row, other=float("-inf"))
    index = tl.load(part_index_ptr + part, mask=in_row, other=vocab_size)
    mass_above = tl.sum(tl.load(part_mass_ptr + part, mask=in_row, other=0.0), 0)
    best = tl.max(score, 0)
    token = tl.min(tl.where(score == best, index, vocab_size), 0)
    num = tl.load(cand_count_ptr + row)
    failed = (num > CANDIDATE_CAP).to(tl.int32)
    if (mode == _MODE_GATHER) & (num <= CANDIDATE_CAP):
        m = tl.load(plan + _P_MAX)
        slots = tl.arange(0, CANDIDATE_CAP)
        listed = slots < num
        src = row.to(tl.int64) * CANDIDATE_CAP + slots
        value = tl.load(cand_value_ptr + src, mask=listed, other=float("-inf"))
        ids = tl.load(cand_index_ptr + src, mask=listed, other=0)
        key = _key(value)
        weight = tl.where(listed, tl.exp(value - m), 0.0)
        top_k_on = (top_k > 0) & (top_k < vocab_size)
        k_key = tl.full([], _NO_KEY, tl.int32)
        if top_k_on:
            # The list holds the whole top set (nothing above it was left out).
            failed = tl.maximum(failed, (num < top_k).to(tl.int32))
            k_key = _kth_key(key, listed, top_k)
        kept = listed & (key >= k_key)
        kept_mass = tl.sum(tl.where(kept, weight, 0.0), 0)
        p_key = k_key
        if top_p < 1.0:
            target = top_p * tl.where(top_k_on, kept_mass, tl.load(plan + _P_MASS))
            # The search put the threshold inside the list; summed in another order, the
            # masses may disagree by rounding, and then the whole-row path decides.
            bounded = tl.load(plan + _P_HIGH) < float("inf")
            missed = (mass_above + kept_mass < target) | (bounded & (mass_above >= target))
            failed = tl.maximum(failed, missed.to(tl.int32))
            p_key = _mass_key(key, kept, weight, mass_above, target)
        t_key = tl.maximum(tl.maximum(k_key, p_key), _key(_min_p_threshold(m, min_p)))
        g = _gumbel(seed, pos.to(tl.uint32), ids.to(tl.uint32))
        race = tl.where(listed & (key >= t_key), value + g, float("-inf"))
        listed_best = tl.max(race, 0)
        listed_token = tl.min(tl.where(race == listed_best, ids, vocab_size), 0)
        better = (listed_best > best) | ((listed_best == best) & (listed_token < token))
        token = tl.where(better, listed_token, token)
        best = tl.where(better, listed_best, best)
    if failed == 0:
        # Every kept score is -inf only when every logit is: stay greedy then.
        token = tl.where(best == float("-inf"), tl.load(plan_int + _P_GREEDY), token)
        tl.store(out_ptr + row, token.to(tl.int64))
        if COMMIT:
            keep = (tl.load(needs_sample_ptr + row) != 0) & (pos < max_model_len)
            dst = token_table_ptr + slot * stride_token_table + pos
            tl.store(dst, token.to(tl.int32), mask=keep)
    return failed


@triton.jit
def _sample_filtered_row(  # type: ignore[no-untyped-def]
    logits_ptr,
    out_ptr,
    needs_sample_ptr,
    token_table_ptr,
    row,
    slot,
    pos,
    temperature,
    top_k,
    top_p,
    min_p,
    seed,
    stride_logits,
    stride_token_table,
    vocab_size,
    max_model_len,
    COMMIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BISECT_STEPS: tl.constexpr,
    SEARCH_SPAN: tl.constexpr,
):
    # The whole-row path: one program, each bisection step one pass over the row.
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits
    cols = tl.arange(0, BLOCK_V)

    # Pass 1: the largest logit (first index on ties, like torch.argmax) and the smallest.
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    low = tl.full([BLOCK_V], float("inf"), tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        idx = start + cols
        x = tl.load(row_ptr + idx, mask=idx < vocab_size, other=float("-inf"))
        better = x > best
        best_idx = tl.where(better, idx, best_idx)
        best = tl.where(better, x, best)
        low = tl.minimum(low, tl.where(idx < vocab_size, x, float("inf")))
    x_max = tl.max(best, 0)
    greedy_token = tl.min(tl.where(best == x_max, best_idx, vocab_size), 0)

    token = greedy_token
    if temperature > 0.0:
        inv_t = _reciprocal(temperature)
        m = x_max * inv_t
        floor = tl.maximum(tl.min(low, 0) * inv_t, m - SEARCH_SPAN)
        threshold = float("-inf")
        if top_k > 0 and top_k < vocab_size:
            lo = floor
            hi = m
            for _ in range(BISECT_STEPS):
                mid = 0.5 * (lo + hi)
                count = tl.zeros([BLOCK_V], tl.int32)
                for start in range(0, vocab_size, BLOCK_V):
                    idx = start + cols
                    x = tl.load(row_ptr + idx, mask=idx < vocab_size, other=float("-inf"))
                    count += (x * inv_t >= mid).to(tl.int32)
                if tl.sum(count, 0) >= top_k:
                    lo = mid
                else:
                    hi = mid
            threshold = lo
        if top_p < 1.0:
            total = tl.zeros([BLOCK_V], tl.float32)
            for start in range(0, vocab_size, BLOCK_V):
                idx = start + cols
                x = tl.load(row_ptr + idx, mask=idx < vocab_size, other=float("-inf")) * inv_t
                total += tl.where(x >= threshold, tl.exp(x - m), 0.0)
            target = top_p * tl.sum(total, 0)
            lo = tl.maximum(floor, threshold)
            hi = m
            for _ in range(BISECT_STEPS):
                mid = 0.5 * (lo + hi)
                mass = tl.zeros([BLOCK_V], tl.float32)
                for start in range(0, vocab_size, BLOCK_V):
                    idx = start + cols
                    x = tl.load(row_ptr + idx, mask=idx < vocab_size, other=float("-inf"))
                    x = x * inv_t
                    mass += tl.where(x >= mid, tl.exp(x - m), 0.0)
                if tl.sum(mass, 0) >= target:
                    lo = mid
                else:
                    hi = mid
            threshold = tl.maximum(threshold, lo)
        if min_p > 0.0:
            threshold = tl.maximum(threshold, m + tl.log(min_p))

        race = tl.full([BLOCK_V], float("-inf"), tl.float32)
        race_idx = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, vocab_size, BLOCK_V):
            idx = start + cols
            x = tl.load(row_ptr + idx, mask=idx < vocab_size, other=float("-inf")) * inv_t
            g = _gumbel(seed, pos.to(tl.uint32), idx.to(tl.uint32))
            score = tl.where((x >= threshold) & (idx < vocab_size), x + g, float("-inf"))
            better = score > race
            race_idx = tl.where(better, idx, race_idx)
            race = tl.where(better, score, race)
        race_max = tl.max(race, 0)
        token = tl.min(tl.where(race == race_max, race_idx, vocab_size), 0)
        # A row whose every kept score is -inf (cannot happen with finite logits) stays greedy.
        token = tl.where(race_max == float("-inf"), greedy_token, token)

    tl.store(out_ptr + row, token.to(tl.int64))
    if COMMIT:
        keep = (tl.load(needs_sample_ptr + row) != 0) & (pos < max_model_len)
        tl.store(token_table_ptr + slot * stride_token_table + pos, token.to(tl.int32), mask=keep)


@dataclass
class SamplingTable:
    """Per-slot sampling parameters on the device, indexed by a row's request slot.

    The five vectors may be columns of one table (runner V2 keeps them so): they must share
    one element stride, which the kernels use to index them.
    """

    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int32, 0 = off
    top_p: torch.Tensor  # [S] float32, 1 = off
    min_p: torch.Tensor  # [S] float32, 0 = off
    seed: torch.Tensor  # [S] int32 (the low 32 bits of the request's seed)

    @property
    def stride(self) -> int:
        columns = (self.temperature, self.top_k, self.top_p, self.min_p, self.seed)
        strides = {c.stride(0) for c in columns}
        if len(strides) != 1:
            raise ValueError(f"sampling table columns must share one stride, got {strides}")
        return strides.pop()


def sample(
    logits: torch.Tensor,  # [B, V] float32
    row_slot: torch.Tensor,  # [B] int32
    positions: torch.Tensor,  # [B] int32: position of the token being drawn (= seq_len)
    table: SamplingTable,
    commit_to: torch.Tensor | None = None,  # [S, max_model_len] int32 token table
    needs_sample: torch.Tensor | None = None,  # [B] int32, rows whose draw is committed
    any_filtered: bool = True,
) -> torch.Tensor:  # [B] int64
    """Draw one token per row. With `commit_to`, also store each drawn token of a row with
    `needs_sample` at `commit_to[slot, position]`, so the next step reads it on the device.

    Greedy and plain-temperature rows take two launches (vocabulary split, then a per-row
    merge); rows with top-k, top-p or min-p also take the search and gather passes (module
    docstring). `any_filtered=False` (the caller knows no row has those) skips them; a
    filtered row's token is then left unwritten.
    """
    tokens, _ = sample_with_paths(
        logits, row_slot, positions, table, commit_to, needs_sample, any_filtered
    )
    return tokens


@dataclass
class RowPaths:
    """How `sample` drew each row (device tensors, valid once the draw is done)."""

    path: torch.Tensor  # [B] int32: index into FILTER_PATHS
    search_passes: torch.Tensor  # [B] int32: search passes the row used


def sample_with_paths(
    logits: torch.Tensor,  # [B, V] float32
    row_slot: torch.Tensor,  # [B] int32
    positions: torch.Tensor,  # [B] int32
    table: SamplingTable,
    commit_to: torch.Tensor | None = None,
    needs_sample: torch.Tensor | None = None,
    any_filtered: bool = True,
) -> tuple[torch.Tensor, RowPaths | None]:
    """`sample`, also returning how each row was drawn (None when the filter passes did not
    run), for tests and benchmarks."""
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out, None
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    commit = commit_to is not None
    token_table = commit_to if commit_to is not None else out
    flags = needs_sample if needs_sample is not None else row_slot
    stride_params = table.stride
    split = _SPLIT
    num_splits = triton.cdiv(vocab_size, split)
    splits_pad = triton.next_power_of_2(num_splits)
    edges, cap = _EDGES, _CANDIDATE_CAP
    parts = num_rows * num_splits
    # One float and one int workspace, carved into the passes' buffers.
    float_sizes = {"score": parts}
    int_sizes = {"index": parts}
    if any_filtered:
        float_sizes |= {
            "mass": parts,
            "low": parts,
            "edge_count": parts * edges,
            "edge_mass": parts * edges,
            "plan": num_rows * _PLAN_FLOATS.value,
            "edges": num_rows * edges,
            "cand_value": num_rows * cap,
        }
        int_sizes |= {
            "plan": num_rows * _PLAN_INTS.value,
            "cand_index": num_rows * cap,
            "cand_count": num_rows,
        }
    f = _carve(
        torch.empty(sum(float_sizes.values()), dtype=torch.float32, device=logits.device),
        float_sizes,
    )
    i = _carve(
        torch.empty(sum(int_sizes.values()), dtype=torch.int32, device=logits.device), int_sizes
    )
    score, index = f["score"], i["index"]
    # Without filters the merge never reads these: any buffer stands in.
    mass, low, edge_values = f.get("mass", score), f.get("low", score), f.get("edges", score)
    plan, plan_int, cand_count = (
        f.get("plan", score),
        i.get("plan", index),
        i.get("cand_count", index),
    )
    _sample_split_kernel[(num_rows, num_splits)](
        logits,
        score,
        index,
        mass,
        low,
        row_slot,
        positions,
        table.temperature,
        table.top_k,
        table.top_p,
        table.min_p,
        table.seed,
        logits.stride(0),
        stride_params,
        vocab_size,
        num_splits,
        SPLIT=split,
        FILTERS=any_filtered,
        num_warps=4,
        enable_fp_fusion=False,  # y + Gumbel rounded like the reference: no fused x * (1/T) + g
    )
    _sample_merge_kernel[(num_rows,)](
        score,
        index,
        mass,
        low,
        plan,
        plan_int,
        edge_values,
        cand_count,
        out,
        row_slot,
        positions,
        table.temperature,
        table.top_k,
        table.top_p,
        table.min_p,
        flags,
        token_table,
        token_table.stride(0) if commit else 0,
        stride_params,
        vocab_size,
        num_splits,
        token_table.shape[1] if commit else 0,
        COMMIT=commit,
        SPLITS_PAD=splits_pad,
        FILTERS=any_filtered,
        EDGES=edges,
        SEARCH_DEPTH=_SEARCH_DEPTH,
        CANDIDATE_CAP=cap,
    )
    if not any_filtered:
        return out, None
    for _ in range(_SEARCH_LEVELS):
        _filter_search_kernel[(num_rows, num_splits)](
            logits,
            f["edge_count"],
            f["edge_mass"],
            plan,
            plan_int,
            edge_values,
            row_slot,
            table.temperature,
            table.top_k,
            table.top_p,
            table.min_p,
            logits.stride(0),
            stride_params,
            vocab_size,
            num_splits,
            SPLIT=split,
            SUB=min(_SUB, split),
            EDGES=edges,
            SPLITS_PAD=splits_pad,
            SEARCH_LEVELS=_SEARCH_LEVELS,
            CANDIDATE_CAP=cap,
            num_warps=4,
        )
    _filter_gather_kernel[(num_rows, num_splits)](
        logits,
        score,
        index,
        mass,
        plan,
        plan_int,
        f["cand_value"],
        i["cand_index"],
        cand_count,
        row_slot,
        positions,
        table.temperature,
        table.seed,
        logits.stride(0),
        stride_params,
        vocab_size,
        num_splits,
        SPLIT=split,
        SUB=min(_GATHER_SUB, split),
        CANDIDATE_CAP=cap,
        num_warps=4,
        enable_fp_fusion=False,  # y + Gumbel rounded like the reference
    )
    _filter_draw_kernel[(num_rows,)](
        logits,
        out,
        score,
        index,
        mass,
        plan,
        plan_int,
        f["cand_value"],
        i["cand_index"],
        cand_count,
        row_slot,
        positions,
        table.temperature,
        table.top_k,
        table.top_p,
        table.min_p,
        table.seed,
        flags,
        token_table,
        logits.stride(0),
        token_table.stride(0) if commit else 0,
        stride_params,
        vocab_size,
        num_splits,
        token_table.shape[1] if commit else 0,
        COMMIT=commit,
        SPLITS_PAD=splits_pad,
        CANDIDATE_CAP=cap,
        BLOCK_V=2048,
        BISECT_STEPS=_BISECT_STEPS,
        SEARCH_SPAN=_SEARCH_SPAN,
        num_warps=16,  # the candidate list in registers: 16 values a thread at 8192
        enable_fp_fusion=False,
    )
    plan_rows = plan_int.view(num_rows, _PLAN_INTS.value)
    return out, RowPaths(plan_rows[:, _P_MODE.value], plan_rows[:, _P_PASSES.value])


def _carve(flat: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    views, start = {}, 0
    for name, size in sizes.items():
        views[name] = flat[start : start + size]
        start += size
    return views


def _mix32_reference(x: torch.Tensor) -> torch.Tensor:
    mask = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def gumbel_reference(seed: torch.Tensor, pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The kernel's Gumbel noise for broadcastable int64 tensors of seeds, positions, ids."""
    mask = 0xFFFFFFFF
    h = _mix32_reference((seed & mask) ^ ((pos * 0x9E3779B1) & mask))
    h = _mix32_reference(h ^ ((idx * 0x85EBCA77) & mask))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


def sample_reference(
    logits: torch.Tensor,
    row_slot: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTable,
) -> torch.Tensor:
    """Plain-torch twin of `sample` with exact (sorted) thresholds, one row at a time.

    The scaled logits are `x * (1 / T)` with `1 / T` rounded to float32, on every device (what
    the kernels compute, and what torch's division by a scalar computes on the GPU).
    """
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    vocab_size = logits.shape[1]
    ids = torch.arange(vocab_size, device=logits.device)
    for row in range(logits.shape[0]):
        slot = int(row_slot[row])
        x = logits[row].float()
        temperature = float(table.temperature[slot])
        top_k = int(table.top_k[slot])
        if temperature == 0.0 or top_k == 1:
            out[row] = int(torch.argmax(x))
            continue
        x = x * (1.0 / temperature)
        keep = torch.ones_like(x, dtype=torch.bool)
        if 0 < top_k < vocab_size:
            keep &= x >= torch.topk(x, top_k).values[-1]
        top_p = float(table.top_p[slot])
        if top_p < 1.0:
            kept = torch.where(keep, x, float("-inf"))
            values, _ = torch.sort(kept, descending=True)
            probs = torch.softmax(values, 0)
            cutoff = int(torch.searchsorted(torch.cumsum(probs, 0), top_p * probs.sum()))
            keep &= x >= values[min(cutoff, vocab_size - 1)]
        min_p = float(table.min_p[slot])
        if min_p > 0.0:
            keep &= x >= x.max() + torch.log(torch.tensor(min_p))
        seed = torch.tensor(int(table.seed[slot]) & 0xFFFFFFFF, dtype=torch.int64)
        g = gumbel_reference(seed, positions[row].long(), ids)
        out[row] = int(torch.argmax(torch.where(keep, x + g.to(x.device), float("-inf"))))
    return out
