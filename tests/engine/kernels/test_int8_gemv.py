"""int8 codes (an int8 LM head) through the FP8-weight products (kernels/fp8_gemv.py and
kernels/fp8_linear.py): every code widened exactly, and each product against its torch twin.
On a GPU the one-row products widen with packed instructions (`fp8_gemv.widen`), elsewhere
with the plain conversion; both must give the codes' own values."""

from __future__ import annotations

import pytest
import torch

from davit_engine.kernels import fp8_gemv
from davit_engine.kernels.fp8_gemv import GemvConfig
from davit_engine.kernels.fp8_gemv import fp8_gemv as gemv
from davit_engine.kernels.fp8_linear import (
    dequantized_matmul,
    dequantized_matmul_reference,
    fp8_weight_matmul,
    fp8_weight_matmul_reference,
)
from tests.engine.kernels.fp8_cases import rel_err


def _int8_weights(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An [n, k] int8 weight over the whole code range (-128 included) and row scales."""
    weight = torch.randint(-128, 128, (n, k), device=device, dtype=torch.int8)
    scale = torch.rand(n, device=device) * 0.01 + 1e-3
    return weight, scale


def _every_code(device: torch.device) -> torch.Tensor:
    """[256, 256] int8: column j holds each of the 256 codes once (row i: (i + j) mod 256 -
    128), so one column's product with a one-hot row reads every code."""
    i = torch.arange(256, device=device)
    return (((i[:, None] + i[None, :]) % 256) - 128).to(torch.int8)


@pytest.mark.parametrize(
    "config",
    [
        GemvConfig(block_n=8, block_k=64, num_warps=4),  # one K step a round
        GemvConfig(block_n=8, block_k=64, num_warps=4, unroll=2),  # two
        GemvConfig(block_n=4, block_k=128, num_warps=4, split_k=2),  # split K
    ],
    ids=lambda c: c.label,
)
@pytest.mark.parametrize("column", [0, 5, 63, 200, 255])
def test_every_code_widens_exactly(device: torch.device, config: GemvConfig, column: int) -> None:
    """A one-hot row picks one column of W: the product is that column's codes times their
    scale, exactly, for all 256 codes (the widening's sign flip, byte placement and bias)."""
    weight = _every_code(device)
    scale = torch.full((256,), 0.5, device=device)
    x = torch.zeros(1, 256, device=device)
    x[0, column] = 1.0
    out = gemv(x, weight, scale, None, config)
    assert torch.equal(out[0], weight[:, column].float() * 0.5)


def test_every_code_widens_exactly_at_several_rows(device: torch.device) -> None:
    """The few-row form (three rows in one program): three one-hot rows, three columns."""
    weight = _every_code(device)
    scale = torch.ones(256, device=device)
    x = torch.zeros(3, 256, device=device)
    columns = [1, 128, 254]
    for row, column in enumerate(columns):
        x[row, column] = 1.0
    out = gemv(x, weight, scale)
    assert torch.equal(out, weight[:, columns].float().t())


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(device: torch.device, rows: int, bias: bool) -> None:
    """Odd N and K (a partial column block, a K tail inside a step), every row form."""
    torch.manual_seed(rows * 2 + bias)
    n, k = 37, 203
    weight, scale = _int8_weights(n, k, device)
    x = torch.randn(rows, k, device=device)
    b = torch.randn(n, device=device) if bias else None
    out = gemv(x, weight, scale, b, GemvConfig(block_n=8, block_k=64, num_warps=4))
    assert rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 40])
def test_weight_matmul_dispatch_matches_reference(device: torch.device, rows: int) -> None:
    """`fp8_weight_matmul` with int8 codes: the matrix-vector kernel up to MAX_ROWS rows, the
    matrix-unit kernel beyond (codes widened to fp16, exact)."""
    torch.manual_seed(40 + rows)
    weight, scale = _int8_weights(72, 160, device)
    x = torch.randn(rows, 160, device=device)
    b = torch.randn(72, device=device)
    out = fp8_weight_matmul(x, weight, scale, b)
    assert rel_err(out, fp8_weight_matmul_reference(x, weight, scale, b)) < 1e-5


def test_dequantized_matmul_matches_reference(device: torch.device) -> None:
    """Many rows: the codes widened exactly into a transient copy and the library GEMM."""
    torch.manual_seed(9)
    weight, scale = _int8_weights(48, 96, device)
    x = torch.randn(20, 96, device=device)
    b = torch.randn(48, device=device)
    out = dequantized_matmul(x, weight, scale, b)
    assert rel_err(out, dequantized_matmul_reference(x, weight, scale, b)) < 1e-5


def test_int8_is_never_streamed(device: torch.device) -> None:
    """The streamed (tensor memory accelerator) form takes e4m3 tiles only: int8 codes asking
    for it run the plain loads, with the same result."""
    torch.manual_seed(4)
    weight, scale = _int8_weights(40, 256, device)
    x = torch.randn(1, 256, device=device)
    streamed = GemvConfig(block_n=8, block_k=64, num_warps=4, stages=3)
    assert not fp8_gemv.can_stream(x, weight, streamed)
    out = gemv(x, weight, scale, None, streamed)
    assert rel_err(out, fp8_weight_matmul_reference(x, weight, scale)) < 1e-5


def test_packed_widening_only_on_a_gpu(device: torch.device) -> None:
    weight, _ = _int8_weights(8, 16, device)
    fp8 = weight.to(torch.float32).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert not fp8_gemv.int8_prmt(fp8)
    nvidia = device.type == "cuda" and torch.version.hip is None
    assert fp8_gemv.int8_prmt(weight) == (nvidia and fp8_gemv.INT8_WIDEN_PRMT)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2])
def test_lm_head_shape_packed_equals_plain_widening(
    device: torch.device, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama-3.1-8B's LM head (128,256 x 4,096) in bf16: the packed widening and the
    compiler's conversion give the same codes, so the same sums in the same order, bit for
    bit; both within bf16's rounding of the float32 reference."""
    torch.manual_seed(12)
    weight, scale = _int8_weights(128256, 4096, device)
    x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
    packed = gemv(x, weight, scale)
    monkeypatch.setattr(fp8_gemv, "INT8_WIDEN_PRMT", False)
    plain = gemv(x, weight, scale)
    assert torch.equal(packed, plain)
    reference = fp8_weight_matmul_reference(x.float(), weight, scale)
    assert rel_err(packed, reference) < 4e-3


@pytest.mark.gpu
def test_one_row_default_in_a_graph(device: torch.device) -> None:
    """The one-row default (two K steps a round, packed widening) captured and replayed."""
    torch.manual_seed(13)
    weight, scale = _int8_weights(49152, 576, device)
    x = torch.randn(1, 576, device=device, dtype=torch.bfloat16)
    assert fp8_gemv.default_config(1, 49152, device).unroll == fp8_gemv.PLAIN_UNROLL
    expected = gemv(x, weight, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, weight, scale)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    sums = fp8_weight_matmul_reference(x.float(), weight, scale)
    assert rel_err(out, sums) < 4e-3
