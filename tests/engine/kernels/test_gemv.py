from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.gemv import (
    CANDIDATES,
    MAX_ROWS,
    GemvPlan,
    eligible,
    gemv,
    gemv_reference,
)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("config_index", [0, len(CANDIDATES) - 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_reference(
    device: torch.device, rows: int, config_index: int, with_bias: bool
) -> None:
    """Odd sizes: features not a multiple of the block, reduction not a multiple of the tile."""
    torch.manual_seed(0)
    n, k = 70, 300
    dtype = torch.float16
    x = torch.randn(rows, k, device=device).to(dtype)
    weight = (0.1 * torch.randn(n, k, device=device)).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if with_bias else None
    out = gemv(x, weight, bias, CANDIDATES[config_index])
    ref = gemv_reference(x, weight, bias)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert torch.allclose(out.float(), ref.float(), atol=2e-3, rtol=2e-3)


def test_gemv_strided_rows(device: torch.device) -> None:
    """x as rows of a wider buffer (row stride > K)."""
    torch.manual_seed(1)
    buffer = torch.randn(2, 96, device=device).to(torch.float16)
    x = buffer[:, :64]
    weight = (0.1 * torch.randn(40, 64, device=device)).to(torch.float16)
    out = gemv(x, weight, None, CANDIDATES[0])
    assert torch.allclose(out.float(), gemv_reference(x, weight, None).float(), atol=2e-3)


def test_plan_dispatch_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(1, 8, dtype=torch.bfloat16)
    weight = torch.randn(4, 8, dtype=torch.bfloat16)
    assert not eligible(x, weight)  # CPU tensors stay on the library path
    monkeypatch.setenv("DAVIT_TRITON_GEMV", "sideways")
    with pytest.raises(ValueError, match="DAVIT_TRITON_GEMV"):
        GemvPlan.from_env()
    monkeypatch.setenv("DAVIT_TRITON_GEMV", "off")
    plan = GemvPlan.from_env()
    plan.tune([weight])  # nothing measured when off
    assert plan.mode == "off" and not plan.timings
    assert plan.choose(x, weight) is None


@pytest.mark.gpu
def test_plan_measures_and_picks_only_faster_kernels(device: torch.device) -> None:
    torch.manual_seed(2)
    weight = (0.02 * torch.randn(4096, 4096, device=device)).to(torch.bfloat16)
    plan = GemvPlan(mode="auto")
    plan.tune([weight], repeats=5)
    assert len(plan.timings) == 4  # one per row bucket
    for timing in plan.timings:
        if timing.chosen is not None:
            assert timing.candidates_us[timing.chosen] < timing.library_us
            assert plan.table[(4096, 4096, timing.rows)].label() == timing.chosen
    x = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    config = plan.choose(x, weight) or CANDIDATES[0]
    out = gemv(x, weight, None, config)
    ref = torch.nn.functional.linear(x, weight)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
