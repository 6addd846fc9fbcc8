"""The kernels' FP8 rounding and Hadamard tile against torch (kernels/fp8.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from davit_engine.kernels.fp8 import hadamard_tile, round_to_e4m3
from davit_engine.layers.fp8 import hadamard


@triton.jit
def _round_kernel(x_ptr, out_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, round_to_e4m3(x).to(out_ptr.dtype.element_ty))


@triton.jit
def _hadamard_kernel(out_ptr, DIM: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.arange(0, DIM)[:, None]
    j = tl.arange(0, DIM)[None, :]
    tl.store(out_ptr + i * DIM + j, hadamard_tile(DIM, out_ptr.dtype.element_ty))


def test_rounding_matches_torch_cast(device: torch.device) -> None:
    """Every magnitude class: subnormals, normals, values rounding up into the next binade,
    ties, the largest value and beyond (saturated), both signs, zero, negative values that
    round to zero."""
    torch.manual_seed(0)
    x = torch.cat(
        [
            torch.randn(4096) * 0.004,  # subnormal range (below 2^-6)
            torch.randn(4096) * 3,
            torch.linspace(-600, 600, 4096),
            torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 1e9, 2**-10, 3 * 2**-11, 17.0, 18.0]),
        ]
    )
    x = torch.cat([x, torch.zeros(triton.next_power_of_2(x.numel()) - x.numel())]).to(device)
    out = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device=device)
    _round_kernel[(1,)](x, out, N=x.numel())
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    # Bit for bit, negative zeros included (tiny negative values round to -0.0 in torch).
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_hadamard_tile_is_sylvester(device: torch.device, dim: int, dtype: torch.dtype) -> None:
    out = torch.empty(dim, dim, device=device, dtype=dtype)
    _hadamard_kernel[(1,)](out, DIM=dim)
    expected = hadamard(dim, device)
    assert torch.equal(out.float(), expected)
    assert torch.equal(expected @ expected.t(), dim * torch.eye(dim, device=device))
