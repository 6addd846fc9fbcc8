from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.layer_ops import (
    qk_norm_rope,
    qk_norm_rope_reference,
    rms_norm,
    rms_norm_reference,
    silu_mul,
    silu_mul_reference,
)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    # float32 summation order may differ from torch's; nothing else may
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    return bool(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_2d_and_strided_3d(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = (1 + 0.1 * torch.randn(32, device=device)).to(dtype)
    x = torch.randn(5, 32, device=device).to(dtype)
    assert _close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), dtype)
    # q heads as a strided view of a fused projection: [T, H, D] with row stride != H * D
    fused = torch.randn(7, 3 * 32 + 16, device=device).to(dtype)
    q = fused[:, : 3 * 32].view(7, 3, 32)
    assert _close(rms_norm(q, weight, 1e-6), rms_norm_reference(q, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope(device: torch.device, dtype: torch.dtype, with_norm: bool) -> None:
    torch.manual_seed(1)
    dim, positions = 16, torch.tensor([0, 5, 9, 2], device=device)
    angles = torch.outer(torch.arange(12.0, device=device), torch.rand(dim // 2, device=device))
    emb = torch.cat((angles, angles), dim=-1)
    # as the model looks them up once per step: [T, 1, D] in the activation dtype
    cos = emb.cos()[positions].unsqueeze(1).to(dtype)
    sin = emb.sin()[positions].unsqueeze(1).to(dtype)
    qkv = torch.randn(4, 3 + 2 * 1, dim, device=device).to(dtype)
    q, k = qkv[:, :3], qkv[:, 3:4]
    weights = (1 + 0.1 * torch.randn(2, dim, device=device)).to(dtype) if with_norm else None
    qw = weights[0] if weights is not None else None
    kw = weights[1] if weights is not None else None
    ours = qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)
    ref = qk_norm_rope_reference(q, k, cos, sin, qw, kw, 1e-6)
    for a, b in zip(ours, ref, strict=True):
        assert _close(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    x = (3 * torch.randn(3, 2 * 1500, device=device)).to(dtype)
    assert _close(silu_mul(x), silu_mul_reference(x), dtype)


@pytest.mark.gpu
def test_bf16_real_shapes_match_reference_closely(device: torch.device) -> None:
    torch.manual_seed(3)
    dtype = torch.bfloat16
    x = torch.randn(256, 4096, device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(4096, device=device)).to(dtype)
    ours, ref = rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)
    assert float((ours != ref).float().mean()) < 0.01  # rare last-bit rounding differences
    gate_up = torch.randn(256, 2 * 14336, device=device, dtype=dtype)
    ours, ref = silu_mul(gate_up), silu_mul_reference(gate_up)
    assert float((ours != ref).float().mean()) < 0.01
    angles = torch.outer(torch.arange(4096.0), torch.rand(64)).to(device)
    emb = torch.cat((angles, angles), dim=-1)
    qkv = torch.randn(256, 48, 128, device=device, dtype=dtype)
    positions = torch.randint(0, 4096, (256,), device=device)
    cos, sin = emb.cos()[positions].to(dtype), emb.sin()[positions].to(dtype)
    nw = (1 + 0.1 * torch.randn(2, 128, device=device)).to(dtype)
    ours_qk = qk_norm_rope(qkv[:, :32], qkv[:, 32:40], cos, sin, nw[0], nw[1], 1e-6)
    ref_qk = qk_norm_rope_reference(qkv[:, :32], qkv[:, 32:40], cos, sin, nw[0], nw[1], 1e-6)
    for a, b in zip(ours_qk, ref_qk, strict=True):
        assert float((a != b).float().mean()) < 0.01
