"""Block-wise FP8 scales converted to one scale per output channel (quant/block_fp8.py): which
values keep their codes, the bound on the others, and the stream's pairing and refusals."""

from __future__ import annotations

import math

import pytest
import torch

from davit_engine.models.config import WeightBlocks
from davit_engine.quant.block_fp8 import channel_scales_from_blocks, convert_block_scaled
from davit_engine.types import ParamError
from davit_tools.bench.fp8_quality import block_quantize

FP8 = torch.float8_e4m3fn
BLOCKS = WeightBlocks(48, 40, ".weight_scale_inv")


def _truth(codes: torch.Tensor, scales: torch.Tensor, blocks: WeightBlocks) -> torch.Tensor:
    n, k = codes.shape
    full = scales.repeat_interleave(blocks.rows, 0)[:n].repeat_interleave(blocks.cols, 1)[:, :k]
    return codes.float() * full


def _block_weight(n: int = 100, k: int = 90, seed: int = 0) -> torch.Tensor:
    """Columns of very different magnitudes, so that the blocks of a row get different
    scales (ragged edges: 100 x 90 in 48 x 40 blocks)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-3, 1, k)[torch.randperm(k, generator=gen)]
    return torch.randn(n, k, generator=gen) * magnitude


def test_values_of_the_rows_largest_scale_keep_their_codes() -> None:
    codes, scales = block_quantize(_block_weight(), BLOCKS.rows, BLOCKS.cols)
    assert scales.shape == (3, 3)  # ceil(100 / 48), ceil(90 / 40)
    out, channel = channel_scales_from_blocks(codes, scales, BLOCKS)
    assert out.dtype == FP8 and channel.dtype == torch.float32 and channel.shape == (100,)
    truth = _truth(codes, scales, BLOCKS)
    got = out.float() * channel[:, None]
    for row in range(100):
        row_scales = scales[row // BLOCKS.rows]
        assert channel[row] == row_scales.max()  # every block of these rows holds a nonzero
        top = int(row_scales.argmax())
        cols = slice(top * BLOCKS.cols, min(90, (top + 1) * BLOCKS.cols))
        assert torch.equal(out[row, cols].view(torch.uint8), codes[row, cols].view(torch.uint8))
    # Elsewhere one rounding to e4m3 (3 mantissa bits): within half a step of the value, or
    # of the smallest subnormal step for values that small.
    step = torch.maximum(
        truth.abs() * 2.0**-3, channel[:, None] * 2.0**-9
    )  # a normal value's step is 2^-3 of its binade; the subnormal step 2^-9 x the scale
    assert bool(((got - truth).abs() <= step / 2 * (1 + 1e-5)).all())
    assert bool(torch.isfinite(got).all())


def test_equal_scales_along_a_row_change_nothing() -> None:
    codes, scales = block_quantize(_block_weight(), BLOCKS.rows, BLOCKS.cols)
    scales = scales.amax(dim=1, keepdim=True).expand_as(scales).contiguous()
    out, channel = channel_scales_from_blocks(codes, scales, BLOCKS)
    assert torch.equal(out.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(channel, scales[torch.arange(100) // BLOCKS.rows, 0])


def test_an_empty_block_does_not_set_the_rows_scale() -> None:
    """Writers give an all-zero block the scale 1 (no largest value to take one from); the
    row's scale comes from its blocks that hold values, or the values would all flush to 0."""
    weight = _block_weight() * 1e-3
    weight[:, 40:80] = 0.0
    codes, scales = block_quantize(weight, BLOCKS.rows, BLOCKS.cols)
    assert bool((scales[:, 1] == 1.0).all())
    out, channel = channel_scales_from_blocks(codes, scales, BLOCKS)
    assert bool((channel < 1e-3).all())
    got = out.float() * channel[:, None]
    truth = _truth(codes, scales, BLOCKS)
    assert float((got - truth).norm() / truth.norm()) < 0.05
    assert bool((out[:, 40:80].float() == 0).all())


def test_an_all_zero_row_gets_a_positive_scale() -> None:
    weight = _block_weight()
    weight[7] = 0.0
    codes, scales = block_quantize(weight, BLOCKS.rows, BLOCKS.cols)
    out, channel = channel_scales_from_blocks(codes, scales, BLOCKS)
    assert channel[7] > 0 and bool((out[7].float() == 0).all())


def _stream(blocks: WeightBlocks = BLOCKS) -> list[tuple[str, torch.Tensor]]:
    codes, scales = block_quantize(_block_weight(), blocks.rows, blocks.cols)
    return [
        ("model.norm.weight", torch.ones(90)),
        ("model.layers.0.mlp.down_proj.weight", codes),
        ("model.layers.0.mlp.down_proj" + blocks.scale_suffix, scales),
    ]


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (0, 2, 1)])
def test_a_weight_and_its_scale_pair_in_either_order(order: tuple[int, ...]) -> None:
    stream = _stream()
    out = dict(convert_block_scaled([stream[i] for i in order], BLOCKS, "ckpt"))
    assert set(out) == {
        "model.norm.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight_scale",
    }
    expected, channel = channel_scales_from_blocks(stream[1][1], stream[2][1], BLOCKS)
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight"].view(torch.uint8),
                       expected.view(torch.uint8))  # fmt: skip
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight_scale"], channel)
    assert torch.equal(out["model.norm.weight"], torch.ones(90))


def test_compressed_tensors_names_its_block_scales_weight_scale() -> None:
    blocks = WeightBlocks(48, 40, ".weight_scale")
    out = dict(convert_block_scaled(_stream(blocks), blocks, "ckpt"))
    assert out["model.layers.0.mlp.down_proj.weight_scale"].shape == (100,)


def test_a_weight_without_its_scale_is_named() -> None:
    stream = _stream()[:2]
    with pytest.raises(ParamError, match=r"ckpt: FP8 weight 'model\.layers\.0\.mlp\.down_proj\."
                       r"weight' has no block scale '.*down_proj\.weight_scale_inv'"):  # fmt: skip
        list(convert_block_scaled(stream, BLOCKS, "ckpt"))


def test_a_scale_without_its_weight_is_named() -> None:
    stream = [_stream()[2]]
    with pytest.raises(ParamError, match=r"block scale '.*down_proj\.weight_scale_inv' has no"):
        list(convert_block_scaled(stream, BLOCKS, "ckpt"))


@pytest.mark.parametrize(
    ("scale", "match"),
    [
        (torch.ones(3, 2), r"has shape \(3, 2\), expected \(3, 3\)"),
        (torch.ones(300), r"has shape \(300,\), expected \(3, 3\)"),
        (torch.ones(3, 3, dtype=torch.int32), "is int32; expected a float tensor"),
        (torch.full((3, 3), -1.0), "negative or non-finite"),
        (torch.full((3, 3), math.nan), "negative or non-finite"),
    ],
)
def test_bad_block_scales_are_refused_by_name(scale: torch.Tensor, match: str) -> None:
    stream = _stream()
    stream[2] = (stream[2][0], scale)
    with pytest.raises(ParamError, match=match) as err:
        list(convert_block_scaled(stream, BLOCKS, "ckpt"))
    assert "down_proj.weight_scale_inv" in err.value.message


POW2 = WeightBlocks(48, 40, ".weight_scale_inv", power_of_two=True)


def _pow2_stream() -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """A stream whose block scales are powers of two (scale_fmt ue8m0), and those scales."""
    gen = torch.Generator().manual_seed(5)
    exponents = torch.randint(-12, 3, (3, 3), generator=gen)
    scales = torch.ldexp(torch.ones(3, 3), exponents)
    codes = (torch.randn(100, 90, generator=gen) * 60).clamp(-448, 448).to(FP8)
    return [("model.layers.0.mlp.down_proj.weight", codes),
            ("model.layers.0.mlp.down_proj.weight_scale_inv", scales)], scales  # fmt: skip


@pytest.mark.parametrize("stored", ["e8m0", "uint8", "float32"])
def test_power_of_two_scales_in_one_byte(stored: str) -> None:
    """scale_fmt ue8m0: the scales as float8_e8m0fnu, as their bytes (uint8, `2^(b - 127)`) or
    as float32 give the same conversion; with power-of-two ratios every value in e4m3's
    normal range keeps its value exactly."""
    stream, scales = _pow2_stream()
    if stored == "e8m0":
        stream[1] = (stream[1][0], scales.to(torch.float8_e8m0fnu))
    elif stored == "uint8":
        stream[1] = (stream[1][0], scales.to(torch.float8_e8m0fnu).view(torch.uint8))
        assert int(stream[1][1][0, 0]) == int(torch.log2(scales[0, 0])) + 127
    out = dict(convert_block_scaled(stream, POW2, "ckpt"))
    codes = out["model.layers.0.mlp.down_proj.weight"]
    channel = out["model.layers.0.mlp.down_proj.weight_scale"]
    ours = codes.float() * channel[:, None]
    truth = _truth(stream[0][1], scales, POW2)
    normal = (truth.abs() / channel[:, None]) >= 2.0**-6  # e4m3's smallest normal value
    assert torch.equal(ours[normal], truth[normal])
    assert float((ours - truth).abs().max()) <= float(channel.max()) * 2.0**-10


@pytest.mark.parametrize(
    ("scale", "blocks", "match"),
    [
        (torch.full((3, 3), 255, dtype=torch.uint8), POW2, "negative or non-finite"),
        (torch.full((3, 3), 127, dtype=torch.uint8), BLOCKS,
         "is uint8; expected a float tensor$"),
        (torch.ones(3, 3).to(torch.float8_e8m0fnu), BLOCKS, "is float8_e8m0fnu; expected a float"),
        (torch.ones(3, 3, dtype=torch.int32), POW2, "float8_e8m0fnu / uint8 bytes"),
    ],
)  # fmt: skip
def test_power_of_two_scales_only_where_the_checkpoint_says(
    scale: torch.Tensor, blocks: WeightBlocks, match: str
) -> None:
    """One-byte scales are read only under scale_fmt ue8m0; 255 (NaN) is refused."""
    stream, _ = _pow2_stream()
    stream[1] = (stream[1][0], scale)
    with pytest.raises(ParamError, match=match):
        list(convert_block_scaled(stream, blocks, "ckpt"))


@pytest.mark.gpu
def test_the_conversion_on_the_gpu_is_the_cpus() -> None:
    """The loader converts on the model's device: the same codes and scales there."""
    codes, scales = block_quantize(_block_weight(300, 260), BLOCKS.rows, BLOCKS.cols)
    stream = [("m.o_proj.weight", codes), ("m.o_proj.weight_scale_inv", scales)]
    cpu = dict(convert_block_scaled(stream, BLOCKS, "ckpt"))
    gpu = dict(convert_block_scaled(stream, BLOCKS, "ckpt", torch.device("cuda")))
    assert gpu["m.o_proj.weight"].device.type == "cuda"
    assert torch.equal(gpu["m.o_proj.weight"].cpu().view(torch.uint8),
                       cpu["m.o_proj.weight"].view(torch.uint8))  # fmt: skip
    assert torch.equal(gpu["m.o_proj.weight_scale"].cpu(), cpu["m.o_proj.weight_scale"])
