"""Block-scaled FP8 products (kernels/fp8_block.py) against their torch twins and the exact
float64 product of the checkpoint's values."""

from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.fp8_block import (
    block_values,
    block_weight_matmul,
    block_weight_matmul_reference,
    kernel_group,
    quantize_groups,
    widen_blocks,
)
from tests.engine.kernels.fp8_cases import rel_err


def _block_weight(
    n: int, k: int, group: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [n, k] and scales [n, ceil(k / group)] spread over four orders of magnitude,
    so that applying a group's scale to another group's sums would show."""
    codes = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    groups = -(-k // group)
    scale = 10.0 ** (-4 * torch.rand(n, groups, device=device)) * 0.01
    return codes, scale.float().contiguous()


def _exact(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return x.double() @ block_values(codes, scale, group).double().t()


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 40])  # the two kernels, partial tiles
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("group_major", [False, True])  # the scales' storage, as prepared
def test_block_weight_matmul_matches_reference(
    device: torch.device, rows: int, bias: bool, group_major: bool
) -> None:
    torch.manual_seed(rows)
    n, k, group = 72, 80, 32  # a partial last group, columns past the tiles
    codes, scale = _block_weight(n, k, group, device)
    if group_major:
        scale = scale.t().contiguous().t()
    x = torch.randn(rows, k, device=device)
    b = torch.randn(n, device=device) if bias else None
    out = block_weight_matmul(x, codes, scale, group, b)
    assert out.shape == (rows, n) and out.dtype == x.dtype
    assert rel_err(out, block_weight_matmul_reference(x, codes, scale, group, b)) < 1e-5
    exact = _exact(x, codes, scale, group) + (b.double() if b is not None else 0)
    assert rel_err(out, exact) < 1e-5


@pytest.mark.parametrize("rows", [1, 20])
def test_bf16_activations(device: torch.device, rows: int) -> None:
    """bf16 activations: the matrix-vector kernel widens them to float32 exactly, the tile
    multiplies in fp16 (bf16 values of this range are fp16 values too); float32 sums."""
    torch.manual_seed(rows + 7)
    codes, scale = _block_weight(48, 128, 64, device)
    x = torch.randn(rows, 128, device=device).bfloat16()
    out = block_weight_matmul(x, codes, scale, 64)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, _exact(x, codes, scale, 64)) < 4e-3  # bf16 output rounding


def test_each_group_takes_its_own_scale(device: torch.device) -> None:
    """One nonzero group of columns: the output is that group's sum times its scale only."""
    n, k, group = 16, 64, 16
    codes = torch.zeros(n, k, device=device)
    codes[:, 32:48] = 2.0
    scale = torch.ones(n, k // group, device=device)
    scale[:, 2] = 0.5
    x = torch.ones(1, k, device=device)
    out = block_weight_matmul(x, codes.to(torch.float8_e4m3fn), scale.contiguous(), group)
    assert torch.equal(out, torch.full((1, n), 16.0, device=device))


def test_no_rows_and_bad_groups(device: torch.device) -> None:
    codes, scale = _block_weight(8, 32, 16, device)
    assert block_weight_matmul(torch.empty(0, 32, device=device), codes, scale, 16).shape == (0, 8)
    assert kernel_group(128) and kernel_group(16)
    assert not kernel_group(8) and not kernel_group(96) and not kernel_group(512)
    with pytest.raises(AssertionError):  # the scale's groups must match the weight's
        block_weight_matmul(torch.randn(1, 32, device=device), codes, scale[:, :1].contiguous(), 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_widen_blocks_rounds_once(device: torch.device, dtype: torch.dtype) -> None:
    codes, scale = _block_weight(24, 200, 64, device)  # K past the kernel's block, partial group
    scale = scale.t().contiguous().t()  # group-major, as a prepared module stores it
    out = widen_blocks(codes, scale, 64, dtype)
    assert out.dtype == dtype
    rounded = block_values(codes, scale, 64).to(dtype)
    if device.type == "cuda" or dtype == torch.float32:
        assert torch.equal(out, rounded)
    else:  # Triton's interpreter narrows float32 by truncation: within one unit of the last place
        ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
        assert torch.allclose(out.float(), rounded.float(), rtol=ulp, atol=0)


def _quantize_groups_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    values = x.float().view(x.shape[0], -1, group)
    scale = (values.abs().amax(dim=2) / 448).clamp(min=1e-12)
    return (values / scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "group"), [(256, 128), (1280, 128), (96, 32)])
def test_quantize_groups_kernel_matches_torch(
    device: torch.device, dtype: torch.dtype, k: int, group: int
) -> None:
    """The kernel (the GPU's, or the interpreter's on the CPU) against torch's arithmetic, bit
    for bit: codes, scales in either layout (1,280 columns: 10 groups, a program's groups past
    the row's end), an all-zero group (the minimum scale), a row read through a stride."""
    torch.manual_seed(k + group)
    wide = torch.randn(7, k + 64, device=device) * torch.logspace(-3, 2, k + 64, device=device)
    wide[2, 32 : 32 + group] = 0.0
    x = wide[:, 32 : 32 + k].to(dtype)
    want_codes, want_scale = _quantize_groups_torch(x, group)
    for rows_minor in (False, True):
        codes, scale = quantize_groups(x, group, rows_minor=rows_minor)
        assert torch.equal(codes.view(torch.uint8).view(7, -1, group),
                           want_codes.view(torch.uint8))  # fmt: skip
        assert torch.equal(scale, want_scale) and scale.shape == (7, k // group)
        assert scale.stride(0) == (1 if rows_minor else k // group)
    assert float(want_scale[2, 0]) == float(torch.tensor(1e-12))  # the all-zero group


def test_quantize_groups() -> None:
    torch.manual_seed(3)
    x = torch.randn(5, 256) * torch.logspace(-3, 2, 256)  # groups of very different sizes
    codes, scale = quantize_groups(x, 128)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (5, 2)
    assert torch.allclose(scale, x.view(5, 2, 128).abs().amax(2) / 448)
    back = codes.float().view(5, 2, 128) * scale[:, :, None]
    # e4m3's 3 mantissa bits: within 1/16 of each group's largest value, relative, or exact
    err = (back - x.view(5, 2, 128)).abs().amax(2) / x.view(5, 2, 128).abs().amax(2)
    assert float(err.max()) <= 1 / 16
    assert float(codes.float().abs().amax()) == 448.0  # each group's largest value saturates
    with pytest.raises(AssertionError):
        quantize_groups(torch.randn(2, 100), 128)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_epilogue_is_the_product_then_silu_mul(
    device: torch.device, rows: int, dtype: torch.dtype
) -> None:
    """`silu(gate) * up` in the matrix-vector kernel's epilogue: the numbers of the product
    followed by `layer_ops.silu_mul` (gate and up rounded to the activation dtype first);
    output columns past a program's tile and a partial last group included."""
    from davit_engine.kernels.fp8_block import block_gemv_silu_mul
    from davit_engine.kernels.layer_ops import silu_mul

    torch.manual_seed(rows)
    codes, scale = _block_weight(2 * 20, 72, 32, device)  # 20 outputs: a partial tile
    scale = scale.t().contiguous().t()
    x = torch.randn(rows, 72, device=device).to(dtype)
    bias = torch.randn(40, device=device).to(dtype)
    gated = block_gemv_silu_mul(x, codes, scale, 32, bias)
    separate = silu_mul(block_weight_matmul(x, codes, scale, 32, bias))
    assert gated.shape == (rows, 20) and gated.dtype == dtype
    assert rel_err(gated, separate) < (1e-6 if dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="even count"):
        block_gemv_silu_mul(x, codes[:39], scale[:39], 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "gated", "bias"), [(72, False, True), (80, True, False)])
def test_one_row_chain_with_the_norm_folded_in(
    device: torch.device, dtype: torch.dtype, n: int, gated: bool, bias: bool
) -> None:
    """The norm chain's block forms (runner V2 at one token over `--fp8-block-scales native`):
    a producer (o or down) with the residual add and the next norm's weight in its epilogue,
    then a consumer (q/k/v with a bias, or gate/up gated) applying the norm's 1/rms to its
    sums, against the unfused kernels (the product, `add_rms_norm`, the product). The residual
    stream is the unfused kernels' bit for bit; the consumer's output differs by one rounding
    of its input, as for per-channel scales (kernels/fp8_gemv.py)."""
    _block_norm_chain_case(device, dtype, n, 96, 80, 32, gated, bias)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "gated"), [(6144, False), (28672, True)])
def test_one_row_chain_with_the_norm_folded_in_real_shapes(
    n: int, gated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama-3.1-8B's shapes in bf16 with 128-column groups: o then q/k/v, down then gate/up;
    the consumer's output is the same bit for bit without the one-row register cap."""
    from davit_engine.kernels import fp8_block

    args = (torch.device("cuda"), torch.bfloat16, n, 4096, 14336 if gated else 4096, 128)
    capped = _block_norm_chain_case(*args, gated, False)
    monkeypatch.setattr(fp8_block, "ONE_ROW_MAX_REGISTERS", None)
    assert torch.equal(_block_norm_chain_case(*args, gated, False), capped)


def test_one_row_launches_take_the_register_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The matrix-vector kernel's one-row launches are capped at `ONE_ROW_MAX_REGISTERS`
    (the gated form with the norm's 1/rms compiled to 40 registers uncapped: fewer programs a
    multiprocessor); two rows keep the compiler's count, and None turns the cap off."""
    from davit_engine.kernels import fp8_block

    cpu = torch.device("cpu")
    one = fp8_block._gemv_tile(28672, 4096, 128, cpu)
    assert one["maxnreg"] == fp8_block.ONE_ROW_MAX_REGISTERS == 32
    assert one["TWO_ROWS"] is False and one["EVEN_K"] is True
    two = fp8_block._gemv_tile(28672, 4096, 128, cpu, two_rows=True)
    assert "maxnreg" not in two and two["TWO_ROWS"] is True
    monkeypatch.setattr(fp8_block, "ONE_ROW_MAX_REGISTERS", None)
    assert "maxnreg" not in fp8_block._gemv_tile(28672, 4096, 128, cpu)


def _block_norm_chain_case(
    device: torch.device, dtype: torch.dtype, n: int, k: int, k_in: int, group: int,
    gated: bool, bias: bool,
) -> torch.Tensor:  # fmt: skip
    """Runs the chain's checks; returns the consumer's output."""
    from davit_engine.kernels.fp8_block import block_gemv_add_norm, block_gemv_normed
    from davit_engine.kernels.layer_ops import add_rms_norm, silu_mul

    torch.manual_seed(n + k + gated)
    eps = 1e-5
    w_o, s_o = _block_weight(k, k_in, group, device)  # producer: k_in inputs -> hidden size k
    w_next, s_next = _block_weight(n, k, group, device)
    s_o, s_next = s_o.t().contiguous().t(), s_next.t().contiguous().t()  # group-major, prepared
    x = torch.randn(1, k_in, device=device).to(dtype)
    residual = (torch.randn(1, k, device=device) * 3).to(dtype)
    norm_w = (torch.rand(k, device=device) + 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None

    y = block_weight_matmul(x, w_o, s_o, group)
    ref_x, ref_s = add_rms_norm(y, residual.clone(), norm_w, eps)
    ref = block_weight_matmul(ref_x, w_next, s_next, group, b)
    if gated:
        ref = silu_mul(ref)

    fused_res = residual.clone()
    xw, squares = block_gemv_add_norm(x, w_o, s_o, group, fused_res, norm_w)
    assert torch.equal(fused_res, ref_s)
    # one rounding of s * norm weight (the interpreter rounds bf16 toward zero, the GPU to
    # nearest: within one step of the product either way)
    want = ref_s.float() * norm_w.float()
    assert bool(((xw.float() - want).abs() <= want.abs() * torch.finfo(dtype).eps).all())
    assert abs(float(squares.double().sum()) / float(ref_s.double().pow(2).sum()) - 1) < 1e-5
    out = block_gemv_normed(xw, squares, eps, w_next, s_next, group, b, gated=gated)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1.5e-2)
    with pytest.raises(ValueError, match="one row only"):
        block_gemv_normed(torch.cat([xw, xw]), squares, eps, w_next, s_next, group)
    with pytest.raises(ValueError, match="one row only"):
        block_gemv_add_norm(torch.cat([x, x]), w_o, s_o, group, fused_res, norm_w)
    return out
