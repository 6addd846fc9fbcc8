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


def _fp8_case(
    device: torch.device, dtype: torch.dtype, tokens: int, heads: int, dim: int, blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    page = 4
    cache = torch.randn(2, blocks, page, heads, dim, device=device).to(torch.float8_e4m3fn)
    kv = torch.randn(tokens, 2, heads, dim, device=device)
    kv[:, 0, :, 1] *= 30  # an outlier key channel, as LLM keys have
    kv = kv.to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    # per-head scales, some small enough that the largest keys saturate at 448
    kv_scale = (torch.rand(2, heads, device=device) * 0.2 + 0.01).contiguous()
    slots = torch.randperm(blocks * page, device=device)[:tokens]
    slots[::3] = -1
    ours, ref = cache.clone(), cache.clone()
    write_kv(k, v, ours, slots, kv_scale)
    write_kv_reference(k, v, ref, slots, kv_scale)
    return ours.view(torch.uint8), ref.view(torch.uint8)


@pytest.mark.parametrize("dim", [16, 12])  # rotated keys (power of two) and unrotated
def test_write_kv_fp8_matches_reference_bit_for_bit(device: torch.device, dim: int) -> None:
    torch.manual_seed(2)
    ours, ref = _fp8_case(device, torch.float32, tokens=9, heads=3, dim=dim, blocks=6)
    assert torch.equal(ours, ref)
    assert (ref == 0x7E).any() or (ref == 0xFE).any()  # +-448: saturation was exercised


def test_write_kv_fp8_stores_rotated_keys(device: torch.device) -> None:
    """Rotating back (H^T / D) and scaling gives the keys within e4m3's rounding; the values
    are stored key-minor in each block."""
    from davit_engine.layers.fp8 import fp8_values_by_key, hadamard

    torch.manual_seed(3)
    heads, dim = 2, 16
    k = torch.randn(5, heads, dim, device=device)
    v = torch.randn(5, heads, dim, device=device)
    cache = torch.zeros(2, 2, 4, heads, dim, device=device, dtype=torch.float8_e4m3fn)
    kv_scale = torch.tensor([[0.05, 0.08], [0.01, 0.02]], device=device)
    write_kv(k, v, cache, torch.arange(5, device=device), kv_scale)
    stored_keys = cache[0].float().view(8, heads, dim)[:5]
    # values are stored key-minor within each block: [blocks, heads, dim, block_size]
    stored_values = fp8_values_by_key(cache).float().permute(0, 3, 1, 2).reshape(8, heads, dim)
    keys = (stored_keys * kv_scale[0][:, None]) @ hadamard(dim, device).t() / dim
    values = stored_values[:5] * kv_scale[1][:, None]
    assert float((keys - k).norm() / k.norm()) < 0.04  # 3 mantissa bits: ~2% per element
    assert float((values - v).norm() / v.norm()) < 0.04


@pytest.mark.gpu
def test_write_kv_fp8_bf16_large(device: torch.device) -> None:
    torch.manual_seed(4)
    ours, ref = _fp8_case(device, torch.bfloat16, tokens=3000, heads=8, dim=128, blocks=1024)
    # The rotation's float32 sums may round in another order than torch's: allow a value on
    # the other side of an e4m3 rounding boundary, never more.
    differ = ours != ref
    assert differ.float().mean() < 1e-4
    assert ((ours.view(torch.float8_e4m3fn).float() - ref.view(torch.float8_e4m3fn).float())[differ].abs()
            <= ref.view(torch.float8_e4m3fn).float()[differ].abs() / 8 + 1e-6).all()  # fmt: skip
