"""`Fp8BlockLinear`: a projection served with a block-wise FP8 checkpoint's own scales.

`y = x @ W^T + bias` with `W[n, k] = weight[n, k] * weight_scale[n, k // group]`: `weight` the
checkpoint's e4m3 codes [N, K], `weight_scale` [N, ceil(K / group)] float32, the checkpoint's
block scales repeated over each block's rows (quant/block_fp8.py expands them as they are read),
so W's values are exactly the ones the checkpoint stands for (`--fp8-block-scales native`).
Holding a scale per row costs 4 bytes per `group` weights: 3% of the FP8 weight's bytes at
128-column groups, read by every decode product.

How the product runs (kernels/fp8_block.py):

- CUDA, up to `weight_only_max_rows` rows (decode at small batch), and the projections of
  `UNQUANTIZED_INPUTS` (q/k/v, as with per-channel FP8) below `dequantize_min_rows`: the
  weight-only Triton products, a group's scale applied to the float32 sums over that group;
  the activations are not quantized.
- CUDA, more rows, where the library's block-scaled FP8 GEMM runs (`library_scale` set: bf16
  activations, compute capability 9.0+, `torch.nn.functional.scaled_mm`, 128-column groups
  whose scales are equal over aligned blocks of 128 rows, as 128 x 128 checkpoints' are, and
  K, N multiples of 128): the activations are quantized per token and 128 columns
  (`quantize_groups`) and multiplied FP8 by FP8 with both block scales applied by the library.
- Otherwise from `dequantize_min_rows` rows: W's values rounded once to the activation dtype in
  a transient copy (`widen_blocks`) and the library's GEMM.
- CPU: the same choices in plain torch (float32 products rounded once; the activations'
  per-group quantization emulated where the GPU would quantize them, the widened copy's
  rounding where it would widen), so the quality tests measure what a GPU serves.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from davit_engine.kernels import capability, fp8_block
from davit_engine.kernels.fp8_block import (
    GEMV_MAX_ROWS,
    block_gemv_silu_mul,
    block_values,
    block_weight_matmul,
    block_weight_matmul_reference,
    kernel_group,
    quantize_groups,
    widen_blocks,
)
from davit_engine.kernels.layer_ops import silu_mul
from davit_engine.quant.fp8_linear import (
    UNQUANTIZED_INPUTS,
    Fp8Projection,
    decoder_projections,
)

# The library's block-scaled GEMM: 1 x 128 activation scales, 128 x 128 weight scales.
LIBRARY_BLOCK = 128


class Fp8BlockLinear(Fp8Projection):
    """Drop-in for `nn.Linear` at inference (see the module docstring for the arithmetic)."""

    # Rows up to which CUDA runs the weight-only products (class attributes, as Fp8Linear's).
    weight_only_max_rows = 16
    dequantize_min_rows = 512

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        groups = -(-in_features // group)
        super().__init__(in_features, out_features, (out_features, groups), bias, dtype, device)
        self.group = group
        # [N / 128, K / 128] (the weight's 128 x 128 block scales) where the library's block
        # GEMM can take them: set by `prepare`, once the weights are loaded.
        self.library_scale: torch.Tensor | None = None
        # False for the projections of `UNQUANTIZED_INPUTS`: their activations are never
        # quantized (weight-only products at every row count).
        self.quantize_inputs = True

    def prepare(self) -> None:
        """After loading: the scales stored group-major, and the 128 x 128 block scales the
        library GEMM takes where the per-row scales are equal over every aligned block of 128
        rows (none otherwise)."""
        self.library_scale = None
        # group-major storage, the same [N, G] values: a program's scales of one K step (its
        # rows, one group) are then contiguous (kernels/fp8_block.py)
        self.weight_scale.data = self.weight_scale.data.t().contiguous().t()
        n, k = self.weight.shape
        if self.group != LIBRARY_BLOCK or n % LIBRARY_BLOCK or k % LIBRARY_BLOCK:
            return
        blocks = self.weight_scale.detach().reshape(n // LIBRARY_BLOCK, LIBRARY_BLOCK, -1)
        if bool((blocks == blocks[:, :1]).all()):
            self.library_scale = blocks[:, 0].contiguous()

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W's values in `dtype` (for references and tests)."""
        return block_values(self.weight, self.weight_scale, self.group).to(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight=float8_e4m3fn per row and {self.group} "
            "columns (block-wise checkpoint scales)"
        )

    def _library_shape(self) -> bool:
        return self.library_scale is not None and self.quantize_inputs

    def _uses_library_gemm(self, x: torch.Tensor) -> bool:
        if x.shape[0] <= self.weight_only_max_rows or not self._library_shape():
            return False
        if x.dtype != torch.bfloat16 or not hasattr(F, "scaled_mm"):
            return False
        return capability(x.device) >= (9, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Fp8BlockLinear: input has {x.shape[-1]} features, expected {self.in_features}"
            )
        flat = self._rows(x)
        if flat.device.type == "cuda":
            out = self._forward_cuda(flat)
        else:
            out = self._forward_emulated(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` [..., N / 2] of this projection's output `[gate | up]` (an MLP's
        fused gate/up projection): on CUDA at one or two rows in the matrix-vector kernel's
        epilogue (the same numbers as the product then `layer_ops.silu_mul`), elsewhere the
        two in turn."""
        flat = self._rows(x)
        if (
            flat.device.type == "cuda"
            and flat.shape[0] <= min(GEMV_MAX_ROWS, self.weight_only_max_rows)
            and kernel_group(self.group)
        ):
            out = block_gemv_silu_mul(flat, self.weight, self.weight_scale, self.group, self.bias)
        else:
            out = silu_mul(self(flat))
        return out.view(*x.shape[:-1], self.out_features // 2)

    def folds_norms(self) -> bool:
        return kernel_group(self.group)

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_block.block_gemv_add_norm(
            x, self.weight, self.weight_scale, self.group, residual, norm_weight
        )

    def forward_normed(
        self, x: torch.Tensor, squares: torch.Tensor, eps: float, gated: bool = False
    ) -> torch.Tensor:
        return fp8_block.block_gemv_normed(
            x, squares, eps, self.weight, self.weight_scale, self.group, self.bias, gated=gated
        )

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._uses_library_gemm(x):
            assert self.library_scale is not None
            codes, scales = quantize_groups(x, LIBRARY_BLOCK, rows_minor=True)
            out = F.scaled_mm(
                codes,
                self.weight.t(),  # [K, N], column-major as the library wants it
                scales,  # [M, K / 128] with M contiguous
                F.ScalingType.BlockWise1x128,
                self.library_scale.t(),  # [K / 128, N / 128] with K / 128 contiguous
                F.ScalingType.BlockWise128x128,
                output_dtype=x.dtype,
            )
            return out if self.bias is None else out + self.bias
        if rows >= self.dequantize_min_rows or not kernel_group(self.group):
            return F.linear(x, widen_blocks(self.weight, self.weight_scale, self.group, x.dtype),
                            self.bias)  # fmt: skip
        return block_weight_matmul(x, self.weight, self.weight_scale, self.group, self.bias)

    def _forward_emulated(self, x: torch.Tensor) -> torch.Tensor:
        """What CUDA computes (module docstring), in plain torch."""
        rows = x.shape[0]
        if rows > self.weight_only_max_rows and self._library_shape():
            assert self.library_scale is not None
            codes, scales = quantize_groups(x, LIBRARY_BLOCK)
            values = codes.float() * scales.repeat_interleave(LIBRARY_BLOCK, dim=1)
            out = (values @ block_values(self.weight, self.weight_scale, self.group).t()).to(
                x.dtype
            )
            return out if self.bias is None else out + self.bias
        if rows >= self.dequantize_min_rows or not kernel_group(self.group):
            weight = block_values(self.weight, self.weight_scale, self.group).to(x.dtype)
            out = x.float() @ weight.float().t()  # the library's float32 sums, the bias in them
            return (out if self.bias is None else out + self.bias.float()).to(x.dtype)
        return block_weight_matmul_reference(
            x, self.weight, self.weight_scale, self.group, self.bias
        )


def install_fp8_block_projections(model: nn.Module, group: int) -> int:
    """Replace every decoder projection by an uninitialised `Fp8BlockLinear` of the same shape
    with `group`-column scales (meta before `to_empty`): the parameters a block-wise FP8
    checkpoint, its scales expanded per row, fills. Returns how many."""
    found = decoder_projections(model)
    for parent, name, linear in found:
        module = Fp8BlockLinear(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group,
            linear.weight.dtype,
            linear.weight.device,
        )
        if name in UNQUANTIZED_INPUTS:  # q/k/v: weight-only at every row count
            module.weight_only_max_rows = sys.maxsize
            module.quantize_inputs = False
        setattr(parent, name, module)
    return len(found)


def prepare_block_projections(model: nn.Module) -> int:
    """`prepare` every `Fp8BlockLinear` of `model` (after its weights are loaded); returns how
    many can use the library's block-scaled GEMM."""
    count = 0
    for module in model.modules():
        if isinstance(module, Fp8BlockLinear):
            module.prepare()
            count += module.library_scale is not None
    return count
