"""FP8-weight matrix products and per-row FP8 quantization against their torch twins."""

from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.fp8_linear import (
    SMALL_ROWS_CONFIG,
    dequantize_weight,
    dequantize_weight_reference,
    dequantized_matmul,
    fp8_weight_matmul,
    fp8_weight_matmul_reference,
    quantize_rows,
    quantize_rows_reference,
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
@pytest.mark.parametrize(("n", "k"), [(3, 80), (5, 2500)])  # one K block; two with a tail
def test_dequantize_weight_equals_its_reference(
    device: torch.device, dtype: torch.dtype, n: int, k: int
) -> None:
    """W * scale computed in float32 and rounded once to the activation dtype: on a GPU bit for
    bit the reference's (round to nearest even). Triton's interpreter truncates float32 to bf16
    instead, so there a bf16 element may sit one unit in the last place below the reference's
    magnitude; every element is written either way."""
    torch.manual_seed(n * k)
    weight, scale = _weights(n, k, device)
    out = dequantize_weight(weight, scale, dtype)
    ref = dequantize_weight_reference(weight, scale, dtype)
    assert out.dtype == dtype and out.shape == (n, k)
    if device.type == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        steps = out.view(torch.int16).int() - ref.view(torch.int16).int()
        assert bool(((steps == 0) | (steps == -1)).all()) and bool((out.abs() <= ref.abs()).all())
    # the copy's rounding (one bf16 rounding, 2^-9 at most) is far below e4m3's own (2^-4)
    exact = weight.double() * scale.double()[:, None]
    assert _rel_err(ref.double(), exact) < (2e-3 if dtype != torch.float32 else 1e-7)
    assert _rel_err(out.double(), exact) < (5e-3 if dtype != torch.float32 else 1e-7)


def test_dequantize_weight_of_nothing_and_wrong_input(device: torch.device) -> None:
    weight, scale = _weights(4, 8, device)
    assert dequantize_weight(weight[:0], scale[:0], torch.bfloat16).shape == (0, 8)
    with pytest.raises(AssertionError):
        dequantize_weight(weight.float(), scale, torch.bfloat16)  # not FP8
    with pytest.raises(AssertionError):
        dequantize_weight(weight, scale[:3], torch.bfloat16)  # a scale per row


@pytest.mark.parametrize("bias", [False, True])
def test_dequantized_matmul_matches_the_weight_only_product(
    device: torch.device, bias: bool
) -> None:
    """The library GEMM on the dequantized copy computes the weight-only product up to the
    copy's rounding (float32 activations: none)."""
    torch.manual_seed(31)
    weight, scale = _weights(72, 80, device)
    x = torch.randn(70, 80, device=device)
    b = torch.randn(72, device=device) if bias else None
    out = dequantized_matmul(x, weight, scale, b)
    assert out.dtype == torch.float32 and out.shape == (70, 72)
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 2048])
def test_dequantized_matmul_bf16_real_shape(device: torch.device, rows: int) -> None:
    """q/k/v's shape at prefill's row counts in bf16: within bf16 rounding of the product."""
    torch.manual_seed(rows)
    weight, scale = _weights(6144, 4096, device)
    x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
    out = dequantized_matmul(x, weight, scale)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert _rel_err(out, fp8_weight_matmul_reference(x, weight, scale)) < 1e-2
