"""Shared by the FP8 kernel tests: the relative error they compare with and random FP8 weights."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()  # a module's weights may require grad
    return float((a - b).norm() / b.norm())


def fp8_weights(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An [n, k] e4m3 weight spread over its range and one positive scale per row."""
    # clamped first: torch's CUDA cast (2.11) turns values beyond 448 into NaN
    weight = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, device=device) * 0.01 + 1e-3
    return weight, scale
