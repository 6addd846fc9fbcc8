from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.kv_cache import write_kv, write_kv_reference


def _case(
    device: torch.device, dtype: torch.dtype, tokens: int, heads: int, dim: int, blocks: int
) -> None:
    page = 4
    cache = torch.randn(2, blocks, page, heads, dim, device=device).to(dtype)
    # k and v as strided views of one fused projection, as a model produces them.
    kv = torch.randn(tokens, 2, heads, dim, device=device).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.randperm(blocks * page, device=device)[:tokens]
    slots[::3] = -1  # padding tokens are skipped
    ours, ref = cache.clone(), cache.clone()
    write_kv(k, v, ours, slots)
    write_kv_reference(k, v, ref, slots)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    _case(device, dtype, tokens=7, heads=3, dim=8, blocks=5)


@pytest.mark.gpu
def test_write_kv_bf16_large(device: torch.device) -> None:
    torch.manual_seed(1)
    _case(device, torch.bfloat16, tokens=3000, heads=8, dim=128, blocks=1024)
