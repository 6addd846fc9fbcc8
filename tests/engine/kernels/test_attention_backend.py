from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.attention_backend import NUM_KV_SPLITS_KEY, TritonPagedAttention

attention = pytest.importorskip("davit_engine.layers.attention")


@pytest.mark.parametrize("fixed_splits", [None, 2])
def test_backend_matches_torch_reference_backend(
    device: torch.device, fixed_splits: int | None
) -> None:
    """The Triton backend and the plain-torch backend agree on a mixed step, through the
    AttentionBackend protocol (write_kv, then forward)."""
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 16
    q_lens, seq_lens = [1, 6, 1], [9, 6, 14]
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 7, 8], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    slots = []
    for row, (q_len, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for p in range(s - q_len, s):
            slots.append(int(tables[row, p // page]) * page + p % page)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    q = torch.randn(8, heads, dim, device=device)
    k = torch.randn(8, kv_heads, dim, device=device)
    v = torch.randn(8, kv_heads, dim, device=device)
    base = torch.randn(2, 12, page, kv_heads, dim, device=device)
    outs = []
    for backend in (TritonPagedAttention(), attention.TorchPagedAttention()):
        cache = base.clone()
        meta = attention.AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=qsl.to(device),
            seq_lens=lens.to(device),
            block_tables=tables.to(device),
            max_query_len=6,
            max_seq_len=14,
            backend=backend,
        )
        if fixed_splits is not None:
            meta.scratch[NUM_KV_SPLITS_KEY] = fixed_splits
        backend.write_kv(k, v, cache, slot_mapping)
        outs.append(backend.forward(q, cache, meta, 0.25))
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-4)
