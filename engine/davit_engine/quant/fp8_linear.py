"""`Fp8Linear`: a projection whose weight is stored in FP8 with one scale per output channel.

`y = x @ (W_q * w_scale[:, None])^T + bias`, `W_q` in float8_e4m3fn ([N, K], half a bf16
weight's bytes), `w_scale` float32 [N]. How the product runs depends on the rows and the device:

- CUDA, at most `weight_only_max_rows` rows (decode at small batch): `fp8_weight_matmul`
  (kernels/fp8_linear.py) widens W's tiles in registers; the activations stay as they are. Up
  to `fp8_gemv.MAX_ROWS` rows that is a matrix-vector kernel streaming W at memory bandwidth
  (kernels/fp8_gemv.py), beyond a matrix-unit kernel. The step is bound by reading W, and no
  quantization kernel runs before the product. From `dequantize_min_rows` rows on (q/k/v at
  prefill), where the product is bound by arithmetic, not by W: W widened exactly into a
  transient copy in the activation dtype, the library's GEMM, then the channel scale on its
  output (`dequantized_matmul`).
- CUDA, more rows (except for the projections of `UNQUANTIZED_INPUTS`, q/k/v and an FP8 LM
  head, which keep the weight-only product at every row count), bf16 activations, compute
  capability 9.0+ and K, N multiples of 16 (the library's constraints): the activations are
  quantized per token (one scale per row, its absolute maximum over 448, computed on the fly)
  and `torch._scaled_mm` multiplies FP8 by FP8 with the row and channel scales applied to its
  float32 accumulator. Otherwise the weight-only products again, as above.
- CPU: the same arithmetic in plain torch (FP8 storage, float32 products rounded once to the
  activation dtype), with the per-token quantization of the activations emulated where CUDA
  would quantize them; the quality tests measure this path.

Weights quantized at load take their per-channel scale from the channel's absolute maximum
(`amax / 448`), so no channel saturates.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from davit_engine.kernels import capability, fp8_gemv
from davit_engine.kernels.fp8_linear import (
    dequantized_matmul,
    dequantized_matmul_reference,
    fp8_weight_matmul,
    quantize_rows,
    quantize_rows_reference,
)
from davit_engine.kernels.layer_ops import silu_mul
from davit_engine.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_fp8
from davit_engine.layers.parallel import VocabParallelLMHead
from davit_engine.models.config import DECODER_PROJECTIONS


class Fp8Projection(nn.Module):
    """What the FP8 projections share: uninitialised `weight` [N, K] float8_e4m3fn,
    `weight_scale` float32 of the layout's `scale_shape` and `bias` [N] of `dtype` (or None),
    none requiring grad, and their inputs as rows."""

    in_features: int
    out_features: int
    # the type of `weight`'s codes (`Int8Linear`: int8)
    code_dtype: torch.dtype = FP8_DTYPE
    weight: nn.Parameter  # [N, K] float8_e4m3fn
    weight_scale: nn.Parameter  # float32
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scale_shape: tuple[int, ...],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=self.code_dtype, device=device),
            requires_grad=False,
        )
        self.weight_scale = nn.Parameter(
            torch.empty(scale_shape, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] as rows [M, K] with contiguous columns, as the kernels take them."""
        flat = x.reshape(-1, self.in_features)
        return flat if flat.stride(1) == 1 else flat.contiguous()

    # ---- runner V2's fused forms (runner/v2/fused_layers.py), each layout's own kernels ----

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` [..., N / 2] of this projection's output `[gate | up]`."""
        raise NotImplementedError

    def folds_norms(self) -> bool:
        """Whether the one-row kernels of `forward_add_norm` and `forward_normed` take this
        projection (runner V2's one-token norm chain)."""
        return True

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One row's product with the residual add and the next norm's weight in its epilogue
        (`residual` updated in place): `s * norm weight` and each program's sum of `s^2`."""
        raise NotImplementedError

    def forward_normed(
        self, x: torch.Tensor, squares: torch.Tensor, eps: float, gated: bool = False
    ) -> torch.Tensor:
        """One row's product of `RMSNorm(s)` from `s * norm weight` and a producer's sums of
        squares (`forward_add_norm`); `gated`: `silu(gate) * up` of it."""
        raise NotImplementedError


class Fp8Linear(Fp8Projection):
    """Drop-in for `nn.Linear` at inference (see the module docstring for the arithmetic).

    `weight` [N, K] float8_e4m3fn and `weight_scale` [N] float32 carry the checkpoint names of
    FP8 checkpoints; `bias` stays in the activation dtype.
    """

    # Rows up to which CUDA runs the weight-only product instead of the FP8 library GEMM
    # (decode at small batch). A class attribute, so a benchmark can move the boundary.
    weight_only_max_rows = 16
    # Rows from which a weight-only product widens W and calls the library GEMM instead of the
    # matrix-unit tile (see the module docstring). On an H100 at q/k/v's shape (6,144 x 4,096;
    # bench notes, run 24): tile 40.5 us at 32 and 64 rows, 52.8 at 256, 79.7 at 512, 313.5 at
    # 2,048; the library GEMM on a bf16 copy of W (then with the scale folded into the copy)
    # 46.3, 46.3, 52.9, 63.8, 185.5. Also a class attribute.
    dequantize_min_rows = 512

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, (out_features,), bias, dtype, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantize `linear`'s weight per output channel (its bias is kept as is)."""
        return cls.from_weight(linear.weight, linear.bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
        """`weight` [N, K] quantized per output channel, with `bias` [N] kept as is."""
        weight = weight.detach()
        out_features, in_features = weight.shape
        module = cls(in_features, out_features, bias is not None, weight.dtype, weight.device)
        with torch.no_grad():
            codes, scale = cls.quantize(weight)
            module.weight.copy_(codes)
            module.weight_scale.copy_(scale)
            if bias is not None and module.bias is not None:
                module.bias.copy_(bias.detach())
        return module

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K], float32 scales [N]) of `weight` [N, K], one scale per row."""
        return quantize_channels(weight)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """`W_q * w_scale[:, None]` in `dtype` (for references and tests)."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight=float8_e4m3fn per-channel"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        flat = self._rows(x)
        if flat.device.type == "cuda":
            out = self._forward_cuda(flat)
        else:
            out = self._forward_emulated(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` [..., N / 2] of this projection's output `[gate | up]` (an MLP's
        fused gate/up projection). Where CUDA runs the matrix-vector product (up to
        `fp8_gemv.MAX_ROWS` rows) the activation is applied in that kernel's epilogue: the
        same numbers as the product followed by `layer_ops.silu_mul`, one kernel and no
        [rows, N] intermediate; elsewhere the two run one after the other (Triton kernels:
        a GPU, or the CPU under Triton's interpreter)."""
        flat = self._rows(x)
        rows = flat.shape[0]
        if flat.device.type == "cuda" and rows <= min(fp8_gemv.MAX_ROWS, self.weight_only_max_rows):
            out = fp8_gemv.fp8_gemv(flat, self.weight, self.weight_scale, self.bias, gated=True)
        else:
            out = silu_mul(self.forward(flat))
        return out.view(*x.shape[:-1], self.out_features // 2)

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_gemv.fp8_gemv_add_norm(x, self.weight, self.weight_scale, residual, norm_weight)

    def forward_normed(
        self, x: torch.Tensor, squares: torch.Tensor, eps: float, gated: bool = False
    ) -> torch.Tensor:
        return fp8_gemv.fp8_gemv_normed(
            x, squares, eps, self.weight, self.weight_scale, self.bias, gated=gated
        )

    def _uses_library_gemm(self, x: torch.Tensor) -> bool:
        if x.shape[0] <= self.weight_only_max_rows or x.dtype != torch.bfloat16:
            return False
        if self.in_features % 16 or self.out_features % 16:
            return False
        # per-row and per-column scales in torch._scaled_mm: Hopper and newer
        return capability(x.device) >= (9, 0)

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        if not self._uses_library_gemm(x):
            if x.shape[0] >= self.dequantize_min_rows:
                return dequantized_matmul(x, self.weight, self.weight_scale, self.bias)
            return fp8_weight_matmul(x, self.weight, self.weight_scale, self.bias)
        x_q, x_scale = quantize_rows(x)  # [M, K] fp8, [M, 1] fp32
        out = torch._scaled_mm(
            x_q,
            self.weight.t(),  # [K, N], column-major as the library wants it
            scale_a=x_scale,
            scale_b=self.weight_scale.view(1, -1),
            out_dtype=x.dtype,
        )
        if self.bias is not None:
            out = out + self.bias
        return out

    def _forward_emulated(self, x: torch.Tensor) -> torch.Tensor:
        """What CUDA computes, in plain torch: weight-only at few rows, else with the
        activations quantized per token as the library path does; float32 products and scales
        rounded once to the activation dtype, as the kernels' float32 accumulators are."""
        rows = x.shape[0]
        if self.dequantize_min_rows <= rows <= self.weight_only_max_rows:
            return dequantized_matmul_reference(x, self.weight, self.weight_scale, self.bias)
        weight = self.weight.float()
        if rows <= self.weight_only_max_rows:  # the kernels add the bias in float32
            out = (x.float() @ weight.t()) * self.weight_scale
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(x.dtype)
        x_q, x_scale = quantize_rows_reference(x)
        out = ((x_q.float() @ weight.t()) * (x_scale * self.weight_scale[None, :])).to(x.dtype)
        if self.bias is not None:  # after the library product, in the activation dtype
            out = out + self.bias
        return out


class Int8Linear(Fp8Linear):
    """An LM head's weight as int8 codes with one float32 scale per row, `amax / 127`
    (`--lm-head-quantization int8`): the bytes of an FP8 head, with 8 bits of precision
    against e4m3's 4 relative to each row's maximum. On SmolLM2-135M's head over 2,048
    positions of the quality text the mean logit error was 0.053 against an FP8 head's 0.240
    (docs/fp8.md). Weight-only at every row count (the activations are never quantized), in
    `Fp8Linear`'s kernels: the one-row products widen the codes with packed integer and fp16
    instructions (`fp8_gemv.widen`), the others exactly to fp16 or bf16 (every code fits);
    needs no FP8 hardware. The CPU computes the same float32 products in plain torch."""

    code_dtype = torch.int8
    # every row count weight-only: int8 codes never reach the FP8 library GEMM
    weight_only_max_rows = sys.maxsize

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows_int8(weight)

    def folds_norms(self) -> bool:
        return False

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight=int8 per-row"
        )


# The largest int8 code `Int8Linear` uses (symmetric: -128 is never written).
INT8_MAX = 127.0


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] as int8 codes with one float32 scale per row (its absolute maximum over
    127, at least `MIN_SCALE`): codes `round(w / scale)` (half to even) in [-127, 127]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=MIN_SCALE)
    codes = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


# Where the activations are never quantized to FP8: these run the weight-only product at every
# row count, prefill included (on CUDA from `dequantize_min_rows` rows the library's bf16 GEMM
# on a widened copy of W: the bf16 rate rather than FP8's). q/k/v: their rounding reaches the
# attention logits, where it costs the most (SmolLM2-135M, FP8 weights, one CPU: perplexity
# +2.08% with every input quantized, +1.51% with q/k/v's kept and multiplied in float32, +1.70%
# with the widened product at prefill's 512-row chunks; docs/fp8.md, Quality); q/k/v are about
# a ninth of a Llama layer's multiply-adds. The LM head (--lm-head-quantization): its rows are
# the sampled tokens only, and its logits then do not depend on the batch's size.
UNQUANTIZED_INPUTS: frozenset[str] = frozenset({"qkv_proj", "lm_head"})


def _with_input_policy(name: str, module: Fp8Linear) -> Fp8Linear:
    if name in UNQUANTIZED_INPUTS:
        module.weight_only_max_rows = sys.maxsize
    return module


def decoder_projections(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of every `nn.Linear` inside the decoder layers: the
    projections FP8 applies to. The LM head and the embedding keep the model dtype."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no decoder layers (model.layers)")
    found = []
    for parent in layers.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                found.append((parent, name, child))
    return found


# Checkpoint names of the decoder projections' weights (what `quantize_weight_stream` converts).
PROJECTION_WEIGHT_SUFFIXES: tuple[str, ...] = tuple(f".{p}.weight" for p in DECODER_PROJECTIONS)


def quantize_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] as per-channel FP8: (e4m3 codes [N, K], float32 scales [N]), each
    channel's scale its absolute maximum over 448 (at least `MIN_SCALE`)."""
    amax = weight.float().abs().amax(dim=1)  # [N]
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_fp8(weight, scale[:, None]), scale


def quantize_weight_stream(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint stream with every decoder projection's weight replaced by its per-channel
    FP8 codes and `weight_scale`, each weight first rounded to the model's `dtype`: the numbers
    `quantize_projections` gives a loaded model. Tensor parallelism quantizes the stream before
    cutting it, so every rank holds its cut of the single-device quantization (a row-parallel
    projection's channel scales come from whole rows). Each weight is quantized on `device`
    (the model's), one at a time."""
    for name, tensor in weights:
        if name.endswith(PROJECTION_WEIGHT_SUFFIXES) and tensor.dtype != FP8_DTYPE:
            codes, scale = quantize_channels(tensor.to(device=device, dtype=dtype))
            yield name, codes
            yield name.removesuffix(".weight") + ".weight_scale", scale
        else:
            yield name, tensor


def quantize_projections(model: nn.Module) -> int:
    """Replace every decoder projection by its per-channel FP8 quantization; returns how many.

    Each bf16/fp16/fp32 weight is released as soon as its FP8 copy exists, so the peak is the
    unquantized model plus one projection.
    """
    found = decoder_projections(model)
    for parent, name, linear in found:
        setattr(parent, name, _with_input_policy(name, Fp8Linear.from_linear(linear)))
    return len(found)


# `--lm-head-quantization` values and the module each builds.
LM_HEAD_MODULES: dict[str, type[Fp8Linear]] = {"fp8": Fp8Linear, "int8": Int8Linear}


def quantize_lm_head(model: nn.Module, kind: str = "fp8") -> None:
    """Replace the LM head by its per-row quantization, `kind` "fp8" or "int8"
    (`--lm-head-quantization`). A head tied to the embedding gets a quantized copy of its
    own, the embedding keeps the model dtype (it is read one row per token); an untied head's
    weight is released."""
    if kind not in LM_HEAD_MODULES:
        raise ValueError(
            f"--lm-head-quantization: must be one of {', '.join(LM_HEAD_MODULES)}, got {kind!r}"
        )
    module = LM_HEAD_MODULES[kind]
    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelLMHead):  # a tensor-parallel rank's rows (one scale each)
        weight = head.weight
        assert weight is not None
        head.projection = _with_input_policy("lm_head", module.from_weight(weight))
        embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
        if weight is not getattr(embedding, "weight", None):
            head.weight = None
        return
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{type(model).__name__} has no nn.Linear LM head (model.lm_head)")
    model.lm_head = _with_input_policy("lm_head", module.from_linear(head))


def install_fp8_projections(model: nn.Module) -> int:
    """Replace every decoder projection by an uninitialised `Fp8Linear` of the same shape, on
    the projection's device (meta before `to_empty`): the parameters an FP8 checkpoint fills."""
    found = decoder_projections(model)
    for parent, name, linear in found:
        fp8 = Fp8Linear(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            linear.weight.dtype,
            linear.weight.device,
        )
        setattr(parent, name, _with_input_policy(name, fp8))
    return len(found)
