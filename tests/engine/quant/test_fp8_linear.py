"""`Fp8Linear`: per-channel quantization at load, the CPU arithmetic (FP8 storage, compute in
the activation dtype) against a dequantized `nn.Linear`, which projections are swapped, and on a
GPU the CUDA paths (weight-only product, FP8 library GEMM) against the CPU arithmetic."""

from __future__ import annotations

import sys
from typing import cast

import pytest
import torch
from torch import nn

from davit_engine.config import EngineConfig
from davit_engine.kernels.fp8_linear import dequantized_matmul_reference
from davit_engine.kernels.layer_ops import silu_mul
from davit_engine.loader import load_model
from davit_engine.models.llama import LlamaDecoderLayer
from davit_engine.quant.fp8_linear import (
    LM_HEAD_MODULES,
    UNQUANTIZED_INPUTS,
    Fp8Linear,
    Int8Linear,
    install_fp8_projections,
    quantize_lm_head,
    quantize_projections,
)
from tests.engine.kernels.fp8_cases import rel_err as _rel_err

CPU = torch.device("cpu")


def _linear(n: int, k: int, bias: bool, device: torch.device = CPU) -> nn.Linear:
    linear = nn.Linear(k, n, bias=bias, device=device)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-2, 1, n, device=device)[:, None])  # channel ranges
    return linear


def test_from_linear_scales_each_channel_to_its_maximum() -> None:
    torch.manual_seed(0)
    linear = _linear(24, 40, bias=True)
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale.dtype == torch.float32
    assert (fp8.weight.float().abs().amax(dim=1) == 448).all()  # no channel saturates or idles
    assert _rel_err(fp8.dequantized_weight(torch.float32), linear.weight) < 0.03
    assert fp8.bias is not None and torch.equal(fp8.bias, linear.bias)


@pytest.mark.parametrize("rows", [1, 16, 17, 200])  # weight-only up to 16 rows, then W8A8
def test_cpu_arithmetic_is_close_to_the_dequantized_linear(rows: int) -> None:
    torch.manual_seed(rows)
    linear = _linear(48, 64, bias=True)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(rows, 64)
    dequantized = nn.functional.linear(x, fp8.dequantized_weight(torch.float32), fp8.bias)
    out = fp8(x)
    if rows <= Fp8Linear.weight_only_max_rows:  # same product, other summation order
        assert _rel_err(out, dequantized) < 1e-5
    else:  # activations quantized per token too: e4m3's rounding, no more
        assert 1e-4 < _rel_err(out, dequantized) < 0.04
    assert _rel_err(out, linear(x)) < 0.05


def test_leading_dims_are_kept() -> None:
    fp8 = Fp8Linear.from_linear(_linear(8, 16, bias=False))
    assert fp8(torch.randn(2, 3, 16)).shape == (2, 3, 8)


def test_quantize_projections_swaps_decoder_projections_only() -> None:
    loaded = load_model(EngineConfig(model="random:qwen2-tiny", dtype="float32"), CPU)
    model = loaded.model
    count = quantize_projections(model)
    layers = len(model.model.layers)
    assert count == 4 * layers  # qkv, o, gate_up, down
    for layer in (cast(LlamaDecoderLayer, m) for m in model.model.layers):
        assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
        assert layer.self_attn.qkv_proj.bias is not None  # Qwen2's q/k/v bias is kept
        assert isinstance(layer.mlp.down_proj, Fp8Linear)
        # q/k/v keep their inputs unquantized at every row count, the others from 17 rows
        assert layer.self_attn.qkv_proj.weight_only_max_rows == sys.maxsize
        assert layer.self_attn.o_proj.weight_only_max_rows == 16
        assert layer.mlp.down_proj.weight_only_max_rows == 16
    assert type(model.lm_head) is nn.Linear  # the head keeps the model dtype


@pytest.mark.parametrize("fill", ["quantize", "checkpoint"])
def test_qkv_inputs_are_never_quantized(fill: str) -> None:
    """At prefill's row counts the q/k/v product is the weight-only one (the dequantized
    weight's product up to summation order), the o product quantizes its inputs per token;
    the same for projections filled from an FP8 checkpoint."""
    assert {"qkv_proj", "lm_head"} == UNQUANTIZED_INPUTS
    loaded = load_model(EngineConfig(model="random:qwen3-tiny", dtype="float32"), CPU)
    model = loaded.model
    if fill == "quantize":
        quantize_projections(model)
    else:
        install_fp8_projections(model)
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                reference = Fp8Linear.from_linear(
                    nn.Linear(module.in_features, module.out_features, bias=False)
                )
                module.load_state_dict(reference.state_dict())
    attention = cast(LlamaDecoderLayer, model.model.layers[0]).self_attn
    for projection, exact in ((attention.qkv_proj, True), (attention.o_proj, False)):
        assert isinstance(projection, Fp8Linear)
        x = torch.randn(200, projection.in_features)
        dequantized = nn.functional.linear(
            x, projection.dequantized_weight(torch.float32), projection.bias
        )
        err = _rel_err(projection(x), dequantized)
        assert err < 1e-5 if exact else err > 1e-4, (projection, err)


def test_load_with_quantization_flag_reports_fp8() -> None:
    loaded = load_model(
        EngineConfig(model="random:qwen3-tiny", dtype="float32", quantization="fp8"), CPU
    )
    assert loaded.quantization == "fp8"
    layer = cast(LlamaDecoderLayer, loaded.model.model.layers[0])
    assert isinstance(layer.mlp.gate_up_proj, Fp8Linear)


@pytest.mark.parametrize(
    ("kind", "codes", "within"), [("fp8", torch.float8_e4m3fn, 0.05), ("int8", torch.int8, 0.01)]
)
@pytest.mark.parametrize("shape", ["qwen3-tiny", "qwen2-tiny"])  # untied, tied
def test_lm_head_quantization_flag(
    shape: str, kind: str, codes: torch.dtype, within: float
) -> None:
    """--lm-head-quantization fp8 or int8: the head becomes a per-row `Fp8Linear` or
    `Int8Linear` (a tied head a quantized copy of its own; the embedding keeps the model dtype
    and its values); the logits stay close to the unquantized head's (int8 closer); without
    the flag the head is untouched."""
    plain = load_model(EngineConfig(model=f"random:{shape}", dtype="float32"), CPU)
    loaded = load_model(
        EngineConfig(model=f"random:{shape}", dtype="float32", lm_head_quantization=kind), CPU
    )
    assert (plain.lm_head_quantization, loaded.lm_head_quantization) == ("none", kind)
    assert type(plain.model.lm_head) is nn.Linear
    head = loaded.model.lm_head
    assert type(head) is LM_HEAD_MODULES[kind] and head.weight.dtype == codes
    assert loaded.quantization == "none"  # the projections are not asked for
    embedding = loaded.model.model.embed_tokens.weight
    assert embedding.dtype == torch.float32
    assert torch.equal(embedding, plain.model.model.embed_tokens.weight)
    hidden = torch.randn(5, loaded.config.hidden_size)
    logits = loaded.model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert _rel_err(logits, plain.model.compute_logits(hidden)) < within


def test_int8_rows_scale_each_row_to_its_maximum() -> None:
    """`Int8Linear.from_linear`: one scale per row, `amax / 127`; every row's largest weight is
    code +-127, the codes never -128, each weight within half a step of its code's value; a
    zero row gets the smallest scale, not a division by zero."""
    torch.manual_seed(1)
    linear = _linear(24, 40, bias=True)
    with torch.no_grad():
        linear.weight[3] = 0.0
    head = Int8Linear.from_linear(linear)
    assert head.weight.dtype == torch.int8 and head.weight_scale.dtype == torch.float32
    top = head.weight.float().abs().amax(dim=1)
    assert (top[torch.arange(24) != 3] == 127).all() and top[3] == 0
    assert int(head.weight.min()) >= -127
    step = head.weight_scale[:, None]
    error = (head.dequantized_weight(torch.float32) - linear.weight).abs()
    assert (error <= step / 2 * (1 + 1e-6)).all()
    assert head.bias is not None and torch.equal(head.bias, linear.bias)
    assert "int8 per-row" in repr(head) and not head.folds_norms()


@pytest.mark.parametrize("rows", [1, 3, 600])  # the one-row, matrix-unit and widened products
def test_int8_head_is_weight_only_at_every_row_count(rows: int) -> None:
    """An int8 head never quantizes its activations: at every row count the product is the
    float32 product of x with the dequantized weight (rounded once or, from
    `dequantize_min_rows`, as the library GEMM on a widened copy rounds)."""
    torch.manual_seed(rows)
    linear = _linear(48, 64, bias=False)
    head = Int8Linear.from_linear(linear)
    x = torch.randn(rows, 64)
    expected = nn.functional.linear(x, head.dequantized_weight(torch.float32))
    assert _rel_err(head(x), expected) < 1e-5
    assert _rel_err(head(x), linear(x)) < 0.01


def test_lm_head_quantization_refuses_an_unknown_kind() -> None:
    model = load_model(EngineConfig(model="random:qwen3-tiny", dtype="float32"), CPU).model
    with pytest.raises(ValueError, match="--lm-head-quantization"):
        quantize_lm_head(model, "int4")


@pytest.mark.gpu
@pytest.mark.parametrize("unquantized_inputs", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 511, 512, 700])
def test_cuda_paths_match_the_cpu_arithmetic(
    device: torch.device, rows: int, unquantized_inputs: bool
) -> None:
    """Up to 16 rows the Triton weight-only product, beyond that per-token quantization and
    torch._scaled_mm (bf16 on sm_90), or for a projection whose inputs stay unquantized (q/k/v)
    the Triton matrix-unit product, and from `dequantize_min_rows` (512) the library GEMM on a
    dequantized copy of W: each within bf16 rounding of the CPU arithmetic."""
    assert Fp8Linear.dequantize_min_rows == 512
    torch.manual_seed(rows)
    linear = _linear(1024, 512, bias=True, device=device).to(torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear)
    cpu = Fp8Linear.from_linear(linear.float().cpu())
    if unquantized_inputs:
        fp8.weight_only_max_rows = cpu.weight_only_max_rows = sys.maxsize
    x = torch.randn(rows, 512, device=device, dtype=torch.bfloat16)
    out = fp8(x)
    expected = cpu(x.float().cpu())
    assert out.dtype == torch.bfloat16
    assert _rel_err(out.float().cpu(), expected) < 1e-2


@pytest.mark.parametrize("rows", [1, 2, 3, 20])
def test_forward_silu_mul_is_the_activation_of_the_product(device: torch.device, rows: int) -> None:
    """`forward_silu_mul` (an MLP's gate/up projection with SiLU x up): on a GPU at one or two
    rows a single kernel, elsewhere the product then `silu_mul`; always the numbers of those
    two, leading dims kept."""
    torch.manual_seed(60 + rows)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fp8 = Fp8Linear.from_linear(_linear(2 * 40, 96, bias=False, device=device).to(dtype))
    x = torch.randn(rows, 96, device=device, dtype=dtype)
    out = fp8.forward_silu_mul(x)
    assert out.shape == (rows, 40) and out.dtype == dtype
    two_kernels = silu_mul(fp8(x))
    if device.type == "cpu":
        assert torch.equal(out, two_kernels)
    else:
        torch.testing.assert_close(out, two_kernels, rtol=1e-2, atol=1e-3)
    assert fp8.forward_silu_mul(x.view(1, rows, 96)).shape == (1, rows, 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_only_rows_past_the_dequantize_boundary(dtype: torch.dtype) -> None:
    """A projection whose inputs stay unquantized (q/k/v): below `dequantize_min_rows` rows the
    CPU arithmetic multiplies by the FP8 weight in float32, scales and rounds once; from it on
    it rounds as the library GEMM on the widened W does (the product, then scaled). Both stay
    within the activation dtype's rounding of the exact product."""
    torch.manual_seed(5)
    fp8 = Fp8Linear.from_linear(_linear(48, 64, bias=True).to(dtype))
    fp8.weight_only_max_rows = sys.maxsize
    x = torch.randn(Fp8Linear.dequantize_min_rows, 64).to(dtype)
    below = fp8(x[:-1])
    at = fp8(x)
    assert fp8.bias is not None
    bias = fp8.bias.double()
    exact = nn.functional.linear(x.double(), fp8.dequantized_weight(torch.float64), bias)
    close = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel_err(below.double(), exact[:-1]) < close
    assert _rel_err(at.double(), exact) < close
    assert torch.equal(at, dequantized_matmul_reference(x, fp8.weight, fp8.weight_scale, fp8.bias))
