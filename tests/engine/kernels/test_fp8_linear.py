"""FP8-weight matrix products and per-row FP8 quantization against their torch twins."""

from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.fp8_linear import (
    SMALL_ROWS_CONFIG,
    dequantized_matmul,
    dequantized_matmul_reference,
    fp8_weight_matmul,
    fp8_weight_matmul_reference,
    quantize_rows,
    quantize_rows_reference,
    widen_fp8,
)
from tests.engine.kernels.fp8_cases import fp8_weights as _weights
from tests.engine.kernels.fp8_cases import rel_err as _rel_err


@pytest.mark.parametrize("rows", [1, 3, 16, 40])  # decode tile, partial tile, many rows
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_weight_matmul_matches_reference(device: torch.device, rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    n, k = 72, 80  # neither a multiple of the column block nor of the K block
    weight, scale = _weights(n, k, device)
    x = torch.randn(rows, 2 * k, device=device)[:, ::2]  # rows strided: last dim must be 1
    x = x.contiguous() if x.stride(1) != 1 else x
    b = torch.randn(n, device=device) if bias else None
    out = fp8_weight_matmul(x, weight, scale, b)
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


@pytest.mark.parametrize("rows", [1, 20])
def test_fp8_weight_matmul_fp16_activations(device: torch.device, rows: int) -> None:
    """Half-precision activations take the fp16 product (W widened by moving bits)."""
    torch.manual_seed(rows + 100)
    weight, scale = _weights(40, 96, device)
    x = torch.randn(rows, 96, device=device).to(torch.float16)
    out = fp8_weight_matmul(x, weight, scale)
    assert out.dtype == torch.float16
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale)) < 2e-3


def test_fp8_weight_matmul_row_stride(device: torch.device) -> None:
    """Rows of a wider tensor (a view of a fused activation) are read through their stride."""
    torch.manual_seed(5)
    weight, scale = _weights(48, 64, device)
    wide = torch.randn(4, 96, device=device)
    x = wide[:, 16:80]
    out = fp8_weight_matmul(x, weight, scale)
    assert _rel_err(out, fp8_weight_matmul_reference(x.contiguous(), weight, scale)) < 1e-5


def test_quantize_rows_matches_reference(device: torch.device) -> None:
    torch.manual_seed(6)
    x = torch.randn(7, 200, device=device) * torch.logspace(-3, 2, 7, device=device)[:, None]
    x[3] = 0.0  # an all-zero row gets the minimum scale, not a division by zero
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_rows_reference(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert (q.float().abs().amax(dim=1)[[0, 1, 2, 4, 5, 6]] == 448).all()  # amax -> 448
    assert _rel_err(q.float() * scale, x) < 0.03


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 16, 64])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336)])
def test_fp8_weight_matmul_bf16_real_shapes(
    device: torch.device, rows: int, n: int, k: int
) -> None:
    torch.manual_seed(7)
    weight, scale = _weights(n, k, device)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    out = fp8_weight_matmul(x, weight, scale)
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale)) < 1e-2
    assert SMALL_ROWS_CONFIG.block_m == 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_dequantized_matmul_matches_its_reference(
    device: torch.device, dtype: torch.dtype, bias: bool
) -> None:
    """W widened exactly, the library GEMM, then scale and bias on its output: the reference's
    roundings up to summation order, and close to the unrounded product."""
    torch.manual_seed(31 + int(bias))
    weight, scale = _weights(72, 80, device)
    x = torch.randn(70, 80, device=device).to(dtype)
    b = torch.randn(72, device=device).to(dtype) if bias else None
    out = dequantized_matmul(x, weight, scale, b)
    assert out.dtype == dtype and out.shape == (70, 72)
    ref = dequantized_matmul_reference(x, weight, scale, b)
    exact = fp8_weight_matmul_reference(x.double(), weight, scale, b.double() if bias else None)
    close = 1e-6 if dtype == torch.float32 else 8e-3
    assert _rel_err(out.double(), ref.double()) < close
    assert _rel_err(ref.double(), exact) < close


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_widen_fp8_gives_every_value_exactly(device: torch.device, dtype: torch.dtype) -> None:
    """All 254 finite e4m3 codes (quantized weights hold no NaN: they are clamped to 448), in
    a tensor whose size is no multiple of the kernel's block: `weight.to(dtype)`'s values and
    signs (-0 included), bit for bit."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = codes.repeat(40)[:9001]
    weight = codes.view(torch.float8_e4m3fn).reshape(9001, 1).to(device)
    out = widen_fp8(weight, dtype).cpu()
    expected = weight.cpu().to(dtype)
    assert out.dtype == dtype and out.shape == weight.shape
    assert bool(expected.isfinite().all()) and torch.equal(out, expected)
    assert torch.equal(out.signbit(), expected.signbit())


def test_dequantized_matmul_refuses_a_weight_not_in_fp8(device: torch.device) -> None:
    weight, scale = _weights(4, 8, device)
    with pytest.raises(AssertionError):
        dequantized_matmul(torch.randn(2, 8, device=device), weight.float(), scale)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [512, 2048])
def test_dequantized_matmul_bf16_real_shape(device: torch.device, rows: int) -> None:
    """q/k/v's shape at prefill's row counts in bf16: within bf16 rounding of the product."""
    torch.manual_seed(rows)
    weight, scale = _weights(6144, 4096, device)
    x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
    out = dequantized_matmul(x, weight, scale)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale)) < 1e-2
    assert torch.equal(widen_fp8(weight, torch.bfloat16), weight.to(torch.bfloat16))
