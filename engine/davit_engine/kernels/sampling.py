"""Sampling on the GPU: greedy, temperature, top-k, top-p, min-p and per-request seeds.

Penalties are applied to the logits beforehand (kernels/penalties.py).

Randomness comes from a counter-based hash of (request seed, position, token id), so a request's
draw depends only on its own seed and position, never on the batch it shares or on a generator
state that the host would have to advance; nothing here synchronises with the host. A random
draw is a Gumbel-max race: the kept token with the largest `logit / T + Gumbel(hash)` wins, which
samples exactly from the softmax restricted to the kept tokens, without a sort or a normalised
probability vector.

Filters, in this order, on the temperature-scaled logits: top-k keeps the tokens at least as
large as the k-th largest (ties with it stay in), top-p keeps the smallest top set whose
probability mass within the top-k set reaches p, min-p keeps the tokens whose probability is at
least min_p times the largest. The top-k and top-p thresholds are found by bisection on the
value (each step one pass over the row), so no kernel sorts the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_BISECT_STEPS = 32
_SPLIT = 4096  # vocabulary slice per program on the split path
_SEARCH_SPAN = 1000.0  # scaled-logit distance below the maximum where the searches start


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
def _sample_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    out_ptr,
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
    max_model_len,
    COMMIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BISECT_STEPS: tl.constexpr,
    SEARCH_SPAN: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    pos = tl.load(seq_lens_ptr + row)  # the position of the token drawn now
    param = slot * stride_params
    temperature = tl.load(temperature_ptr + param)
    top_k = tl.load(top_k_ptr + param)
    top_p = tl.load(top_p_ptr + param)
    min_p = tl.load(min_p_ptr + param)
    if _is_filtered(temperature, top_k, top_p, min_p, vocab_size):
        _sample_filtered_row(
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
            tl.load(seed_ptr + param).to(tl.uint32),
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
def _is_filtered(temperature, top_k, top_p, min_p, vocab_size):  # type: ignore[no-untyped-def]
    # A random draw with top-k, top-p or min-p: the rows the vocabulary-split path leaves out.
    random = (temperature > 0.0) & (top_k != 1)
    return random & (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0) | (min_p > 0.0))


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
        inv_t = 1.0 / temperature
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


@triton.jit
def _sample_split_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    part_score_ptr,
    part_index_ptr,
    row_slot_ptr,
    seq_lens_ptr,
    temperature_ptr,
    top_k_ptr,
    seed_ptr,
    stride_logits,
    stride_params,
    vocab_size,
    num_splits,
    SPLIT: tl.constexpr,
):
    # One program per (row, slice of SPLIT tokens): the slice's best greedy or Gumbel score.
    row = tl.program_id(0)
    split = tl.program_id(1)
    param = tl.load(row_slot_ptr + row).to(tl.int64) * stride_params
    temperature = tl.load(temperature_ptr + param)
    top_k = tl.load(top_k_ptr + param)
    idx = split * SPLIT + tl.arange(0, SPLIT)
    valid = idx < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_logits + idx, mask=valid, other=0.0)
    if (temperature > 0.0) & (top_k != 1):
        seed = tl.load(seed_ptr + param).to(tl.uint32)
        pos = tl.load(seq_lens_ptr + row).to(tl.uint32)
        x = x * (1.0 / temperature) + _gumbel(seed, pos, idx.to(tl.uint32))
    x = tl.where(valid, x, float("-inf"))
    best = tl.max(x, 0)
    best_idx = tl.min(tl.where(x == best, idx, vocab_size), 0)
    tl.store(part_score_ptr + row * num_splits + split, best)
    tl.store(part_index_ptr + row * num_splits + split, best_idx)


@triton.jit
def _sample_merge_kernel(  # type: ignore[no-untyped-def]
    part_score_ptr,
    part_index_ptr,
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
):
    row = tl.program_id(0)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    param = slot * stride_params
    filtered = _is_filtered(
        tl.load(temperature_ptr + param),
        tl.load(top_k_ptr + param),
        tl.load(top_p_ptr + param),
        tl.load(min_p_ptr + param),
        vocab_size,
    )
    if not filtered:
        splits = tl.arange(0, SPLITS_PAD)
        valid = splits < num_splits
        score = tl.load(part_score_ptr + row * num_splits + splits, mask=valid, other=float("-inf"))
        index = tl.load(part_index_ptr + row * num_splits + splits, mask=valid, other=vocab_size)
        best = tl.max(score, 0)
        token = tl.min(tl.where(score == best, index, vocab_size), 0)
        tl.store(out_ptr + row, token.to(tl.int64))
        if COMMIT:
            pos = tl.load(seq_lens_ptr + row)
            keep = (tl.load(needs_sample_ptr + row) != 0) & (pos < max_model_len)
            dst = token_table_ptr + slot * stride_token_table + pos
            tl.store(dst, token.to(tl.int32), mask=keep)


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

    Greedy and plain-temperature rows are split over the vocabulary (many programs per row);
    rows with top-k, top-p or min-p need whole-row threshold searches and run one program per
    row afterwards. `any_filtered=False` (the caller knows no row has those) skips that launch.
    """
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    commit = commit_to is not None
    token_table = commit_to if commit_to is not None else out
    flags = needs_sample if needs_sample is not None else row_slot
    stride_params = table.stride
    num_splits = triton.cdiv(vocab_size, _SPLIT)
    part_score = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)
    _sample_split_kernel[(num_rows, num_splits)](
        logits,
        part_score,
        part_index,
        row_slot,
        positions,
        table.temperature,
        table.top_k,
        table.seed,
        logits.stride(0),
        stride_params,
        vocab_size,
        num_splits,
        SPLIT=_SPLIT,
        num_warps=4,
    )
    _sample_merge_kernel[(num_rows,)](
        part_score,
        part_index,
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
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
    if not any_filtered:
        return out
    _sample_kernel[(num_rows,)](
        logits,
        out,
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
        token_table.shape[1] if commit else 0,
        COMMIT=commit,
        BLOCK_V=2048,
        BISECT_STEPS=_BISECT_STEPS,
        SEARCH_SPAN=_SEARCH_SPAN,
        num_warps=8,
    )
    return out


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
    """Plain-torch twin of `sample` with exact (sorted) thresholds, one row at a time."""
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
        x = x / temperature
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
