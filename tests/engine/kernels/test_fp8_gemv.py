"""The few-row FP8 matrix-vector product (kernels/fp8_gemv.py) against its torch twin."""

from __future__ import annotations

import pytest
import torch

from davit_engine.kernels import fp8_gemv
from davit_engine.kernels.fp8_gemv import GemvConfig, default_split_k
from davit_engine.kernels.fp8_gemv import fp8_gemv as gemv
from davit_engine.kernels.fp8_linear import fp8_weight_matmul, fp8_weight_matmul_reference
from tests.engine.kernels.fp8_cases import fp8_weights as _weights
from tests.engine.kernels.fp8_cases import rel_err as _rel_err


@pytest.mark.parametrize("rows", list(range(1, 17)))
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(device: torch.device, rows: int, bias: bool) -> None:
    """Every row count up to 16 (several programs' row groups past 4), odd N and K (a partial
    column block, a K tail inside a step)."""
    torch.manual_seed(rows * 2 + bias)
    n, k = 37, 203
    weight, scale = _weights(n, k, device)
    x = torch.randn(rows, k, device=device)
    b = torch.randn(n, device=device) if bias else None
    out = gemv(x, weight, scale, b, GemvConfig(block_n=8, block_k=64, num_warps=4))
    assert out.shape == (rows, n) and out.dtype == x.dtype
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16])
def test_weight_matmul_dispatch_matches_reference(device: torch.device, rows: int) -> None:
    """`fp8_weight_matmul` without a config: the matrix-vector kernel up to MAX_ROWS rows,
    the matrix-unit kernel beyond; both give the reference's result."""
    torch.manual_seed(40 + rows)
    weight, scale = _weights(72, 160, device)
    x = torch.randn(rows, 160, device=device)
    b = torch.randn(72, device=device)
    out = fp8_weight_matmul(x, weight, scale, b)
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


@pytest.mark.parametrize("split_k", [1, 2, 8])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_split_k(device: torch.device, split_k: int, rows: int) -> None:
    """K split over programs, including splits that start past K (1100 = 18 steps of 64 in
    8 splits of 3 steps: the last two are empty) and a last step that ends inside K."""
    torch.manual_seed(split_k * 10 + rows)
    n, k = 24, 1100
    weight, scale = _weights(n, k, device)
    x = torch.randn(rows, k, device=device)
    b = torch.randn(n, device=device)
    cfg = GemvConfig(block_n=8, block_k=64, num_warps=4, split_k=split_k)
    out = gemv(x, weight, scale, b, cfg)
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


def test_gemv_even_k_and_strided_rows(device: torch.device) -> None:
    """K a multiple of the step (the unmasked loads) and rows read through their stride."""
    torch.manual_seed(3)
    weight, scale = _weights(40, 256, device)
    wide = torch.randn(2, 320, device=device)
    x = wide[:, 32:288]
    cfg = GemvConfig(block_n=16, block_k=128, num_warps=4, split_k=2)
    out = gemv(x, weight, scale, None, cfg)
    assert _rel_err(out, fp8_weight_matmul_reference(x.contiguous(), weight, scale)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_half_activations(device: torch.device, dtype: torch.dtype) -> None:
    """Half-precision activations are widened to float32; only the final cast rounds."""
    torch.manual_seed(11)
    weight, scale = _weights(33, 130, device)
    x = torch.randn(2, 130, device=device).to(dtype)
    b = torch.randn(33, device=device).to(dtype)
    out = gemv(x, weight, scale, b)
    assert out.dtype == dtype
    ref = fp8_weight_matmul_reference(x.float(), weight, scale, b.float())
    assert _rel_err(out, ref) < 4e-3  # bf16's own rounding of the result is ~2e-3


def test_default_config_narrows_at_few_columns() -> None:
    gpu = torch.device("cpu")  # the interpreter's stand-in: 4 multiprocessors, 16 programs
    assert fp8_gemv.default_config(1, 128, gpu) == fp8_gemv.ONE_ROW_CONFIG
    assert fp8_gemv.default_config(1, 120, gpu) == fp8_gemv.ONE_ROW_NARROW_CONFIG
    assert fp8_gemv.default_config(3, 4096, gpu) == fp8_gemv.FEW_ROWS_CONFIG


def test_default_split_k_fills_the_gpu() -> None:
    cfg = fp8_gemv.ONE_ROW_CONFIG
    gpu = torch.device("cpu")  # the interpreter's stand-in: 4 multiprocessors
    assert default_split_k(4096, 4096, cfg, gpu) == 1  # 512 programs already
    assert default_split_k(64, 4096, cfg, gpu) == 2  # 8 programs -> 16
    # never fewer than two steps of K per split
    assert default_split_k(8, 1024, GemvConfig(8, 512, 4), gpu) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_bf16_real_shapes(device: torch.device, rows: int, n: int, k: int) -> None:
    torch.manual_seed(7)
    weight, scale = _weights(n, k, device)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    out = gemv(x, weight, scale)
    assert torch.isfinite(out).all()
    assert _rel_err(out, fp8_weight_matmul_reference(x.float(), weight, scale)) < 4e-3
