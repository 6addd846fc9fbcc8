"""FP8 checkpoints with block-wise weight scales: kept as they are, or converted at load to one
scale per output channel.

Some FP8 checkpoints scale each `[rows, cols]` block of a projection's weight on its own (Qwen3's
own FP8 releases: `quant_method: fp8` with `weight_block_size: [128, 128]` and a
`weight_scale_inv` tensor; compressed-tensors' block strategy: `block_structure` and a 2-D
`weight_scale`). Either way the scale tensor is `[ceil(N / rows), ceil(K / cols)]` float and a
weight value is `q * scale[n // rows, k // cols]`. With `scale_fmt: ue8m0` the scales are powers
of two stored in one byte each (float8_e8m0fnu, or its bytes as uint8: `2^(b - 127)`, 255 is
NaN); they are read into float32 exactly, and since the ratio of two of them is a power of two,
the re-quantization below then keeps every value that stays in e4m3's normal range exactly.

With `--fp8-block-scales native` the codes load as they are and each block scale is repeated
over its block's rows (`expand_block_scales`): `Fp8BlockLinear` (quant/fp8_block_linear.py)
multiplies with them, W's values exactly the checkpoint's. With `channel` (the default) the
engine's per-channel FP8 products serve them, so each projection is re-quantized here, once,
as it is read: every value is dequantized exactly in float32, and a row's channel
scale is the largest block scale among the blocks where the row has a nonzero value. Values of
the blocks that carry that scale keep their e4m3 codes exactly; values of blocks with a smaller
scale are multiplied by the ratio of the two scales and rounded to e4m3 again (round to nearest
even), which no value can overflow since the ratio is at most 1. That second rounding is the
conversion's only loss; docs/fp8.md gives its size on SmolLM2 (perplexity, block checkpoint
as written against as converted).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from davit_engine.layers.fp8 import FP8_DTYPE, FP8_MAX, check_scale_values
from davit_engine.models.config import WeightBlocks
from davit_engine.types import ParamError

WEIGHT_SUFFIX = ".weight"
# The channel scale tensor the model's loader takes (models/llama.py, per-channel FP8).
CHANNEL_SCALE_SUFFIX = ".weight_scale"


def channel_scales_from_blocks(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    block_scale: torch.Tensor,  # [ceil(N / rows), ceil(K / cols)], a float dtype
    blocks: WeightBlocks,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, K] float8_e4m3fn, [N] float32)
    """The same weight with one scale per output channel (the module docstring's rule)."""
    n, k = weight.shape
    scales = block_scale.float()
    # one row block at a time, so that the float32 copies stay a block of rows tall
    out = torch.empty_like(weight)
    channel = torch.empty(n, dtype=torch.float32, device=weight.device)
    col_blocks = scales.shape[1]
    padded = col_blocks * blocks.cols
    for i in range(scales.shape[0]):
        r0, r1 = i * blocks.rows, min(n, (i + 1) * blocks.rows)
        codes = weight[r0:r1].float()  # [b, K], e4m3 values (exact in float32)
        row_scales = scales[i]  # [col_blocks]
        values = codes * row_scales.repeat_interleave(blocks.cols)[:k]
        nonzero = torch.zeros(r1 - r0, padded, dtype=torch.bool, device=weight.device)
        nonzero[:, :k] = codes != 0
        used = nonzero.view(r1 - r0, col_blocks, blocks.cols).any(dim=2)  # [b, col_blocks]
        chosen = (used * row_scales[None, :]).amax(dim=1)  # scales are >= 0
        chosen = torch.where(chosen > 0, chosen, torch.ones_like(chosen))  # an all-zero row
        requantized = (values / chosen[:, None]).clamp(-FP8_MAX, FP8_MAX)
        out[r0:r1] = requantized.to(FP8_DTYPE)
        channel[r0:r1] = chosen
    return out, channel


_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _scale_values(name: str, scale: torch.Tensor, blocks: WeightBlocks, source: str) -> (
    torch.Tensor
):  # fmt: skip
    """The block scale as float32 values: a float tensor as it is; with power-of-two scales
    (`scale_fmt: ue8m0`) also float8_e8m0fnu and its bytes as uint8. Anything else raises
    ParamError naming the tensor and its dtype."""
    if blocks.power_of_two and scale.dtype == torch.uint8:
        exponent = scale.to(torch.int32) - 127
        values = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
        return torch.where(scale == 255, torch.nan, values)
    if scale.dtype == _E8M0 and blocks.power_of_two:
        return scale.to(torch.float32)
    if not scale.dtype.is_floating_point or scale.dtype in (FP8_DTYPE, _E8M0):
        expected = (
            "a float tensor, or float8_e8m0fnu / uint8 bytes (scale_fmt ue8m0)"
            if blocks.power_of_two
            else "a float tensor"
        )
        raise ParamError(
            "model",
            f"{source}: block scale {name!r} is {str(scale.dtype).removeprefix('torch.')}; "
            f"expected {expected}",
        )
    return scale


def _check_scale(name: str, scale: torch.Tensor, expected: tuple[int, int], source: str) -> None:
    if tuple(scale.shape) != expected:
        raise ParamError(
            "model",
            f"{source}: block scale {name!r} has shape {tuple(scale.shape)}, expected {expected} "
            "(the weight's rows and columns over the checkpoint's weight block size, rounded up)",
        )
    check_scale_values(scale, f"block scale {name!r}", source)


def expand_block_scales(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    block_scale: torch.Tensor,  # [ceil(N / rows), ceil(K / cols)], float32 values
    blocks: WeightBlocks,
) -> torch.Tensor:  # [N, ceil(K / cols)] float32
    """The block scales repeated over each block's rows: one scale per output row and group of
    `cols` input columns, the layout `Fp8BlockLinear` holds (quant/fp8_block_linear.py)."""
    rows = block_scale.float().repeat_interleave(blocks.rows, dim=0)[: weight.shape[0]]
    return rows.contiguous()


def convert_block_scaled(
    weights: Iterable[tuple[str, torch.Tensor]],
    blocks: WeightBlocks,
    source: str,
    device: torch.device | None = None,
    native: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` (checkpoint name, tensor) with every FP8 weight and its block scale replaced by
    the weight re-quantized per channel and its `weight_scale` [N]; with `native`, by the
    weight's codes as they are and its block scales expanded per row (`expand_block_scales`),
    `weight_scale` [N, ceil(K / cols)]. Other tensors pass through.
    A weight and its scale may come in either order (different files of one checkpoint); one
    without the other raises ParamError naming it, once the stream ends. `device`: where the
    conversion runs and the converted tensors stay (the model's; on two CPU cores an 8B
    model's projections take about 40 s to re-quantize, 0.33 s per 14,336 x 4,096 weight)."""
    pending_weights: dict[str, tuple[str, torch.Tensor]] = {}
    pending_scales: dict[str, tuple[str, torch.Tensor]] = {}

    def converted(
        weight_name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if weight.dim() != 2:
            raise ParamError(
                "model",
                f"{source}: FP8 weight {weight_name!r} must be 2-D, got {tuple(weight.shape)}",
            )
        scale = _scale_values(scale_name, scale, blocks, source)
        _check_scale(scale_name, scale, blocks.scale_shape(tuple(weight.shape)), source)
        if device is not None:
            weight, scale = weight.to(device), scale.to(device)
        key = weight_name[: -len(WEIGHT_SUFFIX)]
        if native:
            yield weight_name, weight
            yield key + CHANNEL_SCALE_SUFFIX, expand_block_scales(weight, scale, blocks)
            return
        requantized, channel = channel_scales_from_blocks(weight, scale, blocks)
        yield weight_name, requantized
        yield key + CHANNEL_SCALE_SUFFIX, channel

    for name, tensor in weights:
        if name.endswith(blocks.scale_suffix):
            key = name[: -len(blocks.scale_suffix)]
            if key in pending_weights:
                yield from converted(*pending_weights.pop(key), name, tensor)
            else:
                pending_scales[key] = (name, tensor)
        elif name.endswith(WEIGHT_SUFFIX) and tensor.dtype == FP8_DTYPE:
            key = name[: -len(WEIGHT_SUFFIX)]
            if key in pending_scales:
                yield from converted(name, tensor, *pending_scales.pop(key))
            else:
                pending_weights[key] = (name, tensor)
        else:
            yield name, tensor
    if pending_weights:
        name = sorted(pending_weights)[0]
        raise ParamError(
            "model",
            f"{source}: FP8 weight {name + WEIGHT_SUFFIX!r} has no block scale "
            f"{name + blocks.scale_suffix!r} ({len(pending_weights)} weights without one)",
        )
    if pending_scales:
        name = sorted(pending_scales)[0]
        raise ParamError(
            "model",
            f"{source}: block scale {name + blocks.scale_suffix!r} has no FP8 weight "
            f"{name + WEIGHT_SUFFIX!r} ({len(pending_scales)} scales without one)",
        )
