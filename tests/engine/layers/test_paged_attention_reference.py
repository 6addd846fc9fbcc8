"""The plain-torch paged attention against a dense, per-request computation written out longhand."""

from __future__ import annotations

import math

import pytest
import torch

from davit_engine.layers.attention import AttentionMetadata, TorchPagedAttention

BLOCK = 4
NUM_BLOCKS = 40


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """q: [n, Hq, D] for positions start..start+n-1; k, v: [start+n, Hkv, D] -> [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        visible = start + i + 1  # causal: keys at positions <= this query's position
        scores = torch.einsum("hd,khd->hk", q[i], k[:visible]) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(dim=-1), v[:visible])
    return out


@pytest.mark.parametrize(
    ("context_lens", "query_lens"),
    [
        ([0, 0, 0], [5, 9, 1]),  # fresh prefills of different lengths
        ([7, 12, 3, 20], [1, 1, 1, 1]),  # decode only
        ([0, 13, 5, 8, 0], [6, 1, 7, 1, 1]),  # mixed: prefill, decode, prefix-cached chunk
    ],
)
@pytest.mark.parametrize("num_heads", [(4, 4), (6, 2)])
def test_matches_dense_attention(
    context_lens: list[int], query_lens: list[int], num_heads: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    hq, hkv, head_dim = num_heads[0], num_heads[1], 8
    scale = 1 / math.sqrt(head_dim)
    backend = TorchPagedAttention()
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK, hkv, head_dim)
    # Blocks handed out in a shuffled order, so a request's blocks are not contiguous.
    free = torch.randperm(NUM_BLOCKS).tolist()
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    tables = [[free.pop() for _ in range(-(-s // BLOCK))] for s in seq_lens]
    full_k = [torch.randn(s, hkv, head_dim) for s in seq_lens]
    full_v = [torch.randn(s, hkv, head_dim) for s in seq_lens]
    # The cached context is written as an earlier step would have written it.
    for table, k, v, ctx in zip(tables, full_k, full_v, context_lens, strict=True):
        slots = torch.tensor(
            [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)], dtype=torch.int64
        )
        if ctx:
            backend.write_kv(k[:ctx], v[:ctx], kv_cache, slots)
    q = torch.randn(sum(query_lens), hq, head_dim)
    slot_mapping = []
    new_k, new_v = [], []
    for table, k, v, ctx, n in zip(tables, full_k, full_v, context_lens, query_lens, strict=True):
        slot_mapping += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx, ctx + n)]
        new_k.append(k[ctx : ctx + n])
        new_v.append(v[ctx : ctx + n])
    max_blocks = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
        ),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        backend=backend,
    )
    backend.write_kv(torch.cat(new_k), torch.cat(new_v), kv_cache, meta.slot_mapping)
    out = backend.forward(q, kv_cache, meta, scale)
    # A second layer reuses the per-step plan from meta.scratch and must agree.
    assert "torch_paged_groups" in meta.scratch
    torch.testing.assert_close(backend.forward(q, kv_cache, meta, scale), out)

    start = 0
    for k, v, ctx, n in zip(full_k, full_v, context_lens, query_lens, strict=True):
        expected = dense_attention(q[start : start + n], k[: ctx + n], v[: ctx + n], ctx, scale)
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)
        start += n


def test_write_kv_places_tokens_in_their_slots() -> None:
    backend = TorchPagedAttention()
    kv_cache = torch.zeros(2, 3, BLOCK, 1, 2)
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    backend.write_kv(k, -k, kv_cache, torch.tensor([5, 0, 11]))
    assert torch.equal(kv_cache[0, 1, 1], k[0])
    assert torch.equal(kv_cache[0, 0, 0], k[1])
    assert torch.equal(kv_cache[1, 2, 3], -k[2])
    assert int((kv_cache != 0).sum()) == 2 * 5  # the three tokens only (one value is 0.0)
