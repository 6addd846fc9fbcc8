"""`Fp8BlockLinear` (quant/fp8_block_linear.py): block-wise FP8 checkpoints served with their own
scales. The CPU arithmetic against the exact product of the checkpoint's values in each of the
GPU's regimes, and the GPU's choice of kernels run under Triton's interpreter against it."""

from __future__ import annotations

import sys

import pytest
import torch

from davit_engine.kernels import interpreted
from davit_engine.kernels.fp8_block import block_values
from davit_engine.quant.fp8_block_linear import LIBRARY_BLOCK, Fp8BlockLinear
from tests.engine.kernels.fp8_cases import rel_err

# Tests that run the CUDA kernels on CPU tensors: only under Triton's interpreter (on a GPU
# machine `test_on_the_gpu_each_regime_is_the_cpus` runs the same choices on the card).
interpreter_only = pytest.mark.skipif(
    not interpreted(), reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1"
)


def _module(
    n: int, k: int, group: int, row_block: int, bias: bool = False, seed: int = 0
) -> Fp8BlockLinear:
    """A projection of a [row_block, group]-block checkpoint: random codes, one scale per block
    spread over two orders of magnitude, expanded per row."""
    gen = torch.Generator().manual_seed(seed)
    module = Fp8BlockLinear(k, n, bias, group, torch.float32)
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448)
    blocks = 10.0 ** (-2 * torch.rand(-(-n // row_block), -(-k // group), generator=gen)) * 1e-3
    with torch.no_grad():
        module.weight.copy_(codes.to(torch.float8_e4m3fn))
        module.weight_scale.copy_(blocks.repeat_interleave(row_block, dim=0)[:n])
        if module.bias is not None:
            module.bias.copy_(torch.randn(n, generator=gen))
    module.prepare()
    return module


def _exact(module: Fp8BlockLinear, x: torch.Tensor) -> torch.Tensor:
    out = x.double() @ block_values(module.weight, module.weight_scale, module.group).double().t()
    return out if module.bias is None else out + module.bias.double()


def test_library_scales_only_for_aligned_128_blocks() -> None:
    aligned = _module(256, 384, 128, 128)
    assert aligned.library_scale is not None and aligned.library_scale.shape == (2, 3)
    assert torch.equal(aligned.library_scale.repeat_interleave(128, 0), aligned.weight_scale)
    assert _module(256, 384, 128, 64).library_scale is None  # rows in blocks of 64
    assert _module(200, 384, 128, 128).library_scale is None  # N not a multiple of 128
    assert _module(256, 320, 64, 128).library_scale is None  # 64-column groups
    assert aligned.weight_scale.stride() == (1, 256)  # stored group-major, the same values


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_few_rows_are_the_exact_products_sum(rows: int) -> None:
    """Up to `weight_only_max_rows` rows: the activations as they are, float32 sums."""
    module = _module(256, 384, 128, 128, bias=True)
    x = torch.randn(rows, 384)
    assert rel_err(module(x), _exact(module, x)) < 1e-6


def test_many_rows_quantize_the_activations_per_128_columns() -> None:
    """Past `weight_only_max_rows` rows, where the library's block GEMM runs, the activations
    are rounded to e4m3 per token and 128 columns: within e4m3's rounding of the exact product,
    and exactly the product of the rounded activations."""
    module = _module(256, 384, 128, 128)
    x = torch.randn(40, 384) * torch.logspace(-2, 1, 384)
    out = module(x)
    err = rel_err(out, _exact(module, x))
    assert 1e-4 < err < 0.05  # quantized, and only by e4m3's rounding
    groups = x.view(40, 3, 128)
    scale = groups.abs().amax(2, keepdim=True) / 448
    rounded = ((groups / scale).to(torch.float8_e4m3fn).float() * scale).view(40, 384)
    assert rel_err(out, _exact(module, rounded)) < 1e-6


def test_inputs_never_quantized_keep_the_weight_only_product() -> None:
    module = _module(256, 384, 128, 128)
    module.quantize_inputs, module.weight_only_max_rows = False, sys.maxsize  # q/k/v
    x = torch.randn(40, 384)
    assert rel_err(module(x), _exact(module, x)) < 1e-6


def test_from_dequantize_min_rows_the_widened_copy() -> None:
    """Unaligned blocks at many rows: W's values rounded once to the activation dtype."""
    module = _module(200, 96, 32, 48)
    module.dequantize_min_rows = 20
    x = torch.randn(24, 96).bfloat16()
    widened = block_values(module.weight, module.weight_scale, 32).bfloat16().double()
    want = x.double() @ widened.t()
    assert rel_err(module(x), want) < 4e-3  # the output's bf16 rounding
    assert rel_err(module(x[:3]), _exact(module, x[:3])) < 4e-3  # fewer rows: not widened


@interpreter_only
@pytest.mark.parametrize(
    ("rows", "group", "row_block"),
    [(1, 32, 48), (2, 32, 32), (9, 16, 32), (40, 32, 48), (600, 32, 32)],
)
def test_the_gpu_path_is_the_cpus(rows: int, group: int, row_block: int) -> None:
    """The CUDA choice of kernels (`_forward_cuda`, run by Triton's interpreter on this
    machine: no library block GEMM off a GPU) against the CPU arithmetic where both take the
    same route: the matrix-vector kernel, the tile, the widened copy."""
    module = _module(72, 80, group, row_block, bias=True, seed=rows)
    x = torch.randn(rows, 80)
    assert rel_err(module._forward_cuda(x), module._forward_emulated(x)) < 1e-5
    assert module.library_scale is None


def test_bad_inputs_are_refused() -> None:
    module = _module(128, 128, LIBRARY_BLOCK, 128)
    with pytest.raises(ValueError, match="64 features, expected 128"):
        module(torch.randn(2, 64))  # as many values as one row: never read as one


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 9, 16, 40, 600])
def test_on_the_gpu_each_regime_is_the_cpus(rows: int) -> None:
    """bf16 on a GPU at a Qwen3-like aligned shape (on sm_90 past 16 rows: the library's
    block-scaled FP8 GEMM) and at an unaligned one, against the CPU arithmetic of the same
    module, eagerly and replayed in a CUDA graph."""
    for module in (_module(512, 1024, 128, 128, bias=True), _module(200, 96, 32, 48)):
        x = torch.randn(rows, module.in_features).bfloat16()
        want = _bf16_cpu(module, x)
        gpu = module.cuda()
        gpu.prepare()
        xg = x.cuda()
        got = gpu(xg)
        assert rel_err(got.cpu(), want) < 1e-2, (rows, module.out_features)
        if rows <= 2:  # the gated epilogue of the matrix-vector kernel
            from davit_engine.kernels.layer_ops import silu_mul

            assert rel_err(gpu.forward_silu_mul(xg), silu_mul(got)) < 1e-2
        graph = torch.cuda.CUDAGraph()
        gpu(xg)  # compiles before the capture
        with torch.cuda.graph(graph):
            replayed = gpu(xg)
        graph.replay()
        assert torch.equal(replayed, got)


def _bf16_cpu(module: Fp8BlockLinear, x: torch.Tensor) -> torch.Tensor:
    """The module's CPU arithmetic with bf16 activations (its bias in bf16 as a GPU holds it)."""
    if module.bias is not None:
        module.bias.data = module.bias.data.bfloat16()
    return module(x)


@interpreter_only
def test_silu_mul_of_a_gate_up_projection() -> None:
    """`forward_silu_mul` (the fused MLP's call at decode) is `silu_mul` of the forward."""
    from davit_engine.kernels.layer_ops import silu_mul

    module = _module(96, 64, 32, 32, bias=True)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 64)
        assert torch.equal(module.forward_silu_mul(x), silu_mul(module(x)))
