"""FP8 checkpoints in the common safetensors layout (float8_e4m3fn projection weights with a
per-tensor or per-channel `weight_scale`, config.json's quantization_config), and the schemes the
loader refuses by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file, save_file

from davit_engine.config import EngineConfig
from davit_engine.loader import load_model
from davit_engine.models.config import WeightBlocks
from davit_engine.models.llama import LlamaDecoderLayer
from davit_engine.quant.block_fp8 import channel_scales_from_blocks
from davit_engine.quant.fp8_linear import Fp8Linear
from davit_engine.types import ParamError
from davit_tools.bench.fp8_quality import block_quantize, write_block_fp8_checkpoint
from tests.support import unavailable

CPU = torch.device("cpu")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _fp8_checkpoint(
    source: Path, target: Path, quant: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """`source` (a float32 HF directory) as an FP8 checkpoint: attention projections with one
    scale per tensor, MLP projections one per channel ([N, 1]); static activation and KV scales
    as some checkpoints carry them. Returns the dequantized weights by checkpoint name."""
    target.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        part = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if part not in PROJECTIONS:
            out[name] = tensor
            continue
        per_channel = part in ("gate_proj", "up_proj", "down_proj")
        amax = tensor.abs().amax(dim=1, keepdim=True) if per_channel else tensor.abs().amax()
        scale = (amax / 448).float()
        weight = (tensor / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name] = weight
        out[name.replace(".weight", ".weight_scale")] = scale if per_channel else scale.reshape(())
        out[name.replace(".weight", ".input_scale")] = torch.tensor(0.1)
        dequantized[name] = weight.float() * scale
    layer0 = "model.layers.0.self_attn"
    out[f"{layer0}.k_scale"] = torch.tensor(0.5)
    out[f"{layer0}.v_scale"] = torch.tensor(0.5)
    save_file(out, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quant or FP8_CONFIG
    (target / "config.json").write_text(json.dumps(config))
    return dequantized


def test_fp8_checkpoint_loads_into_fp8_projections(qwen3_tiny_dir: Path, tmp_path: Path) -> None:
    dequantized = _fp8_checkpoint(qwen3_tiny_dir, tmp_path / "fp8")
    loaded = load_model(EngineConfig(model=str(tmp_path / "fp8"), dtype="float32"), CPU)
    assert loaded.quantization == "fp8"  # detected from quantization_config, no flag
    layer = cast(LlamaDecoderLayer, loaded.model.model.layers[0])
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    c = loaded.config
    # Each split projection's per-tensor scale fills its rows of the fused scale.
    q_rows = qkv.dequantized_weight(torch.float32)[: c.q_size]
    assert torch.equal(q_rows, dequantized["model.layers.0.self_attn.q_proj.weight"])
    v_rows = qkv.dequantized_weight(torch.float32)[c.q_size + c.kv_size :]
    assert torch.equal(v_rows, dequantized["model.layers.0.self_attn.v_proj.weight"])
    gate_up = layer.mlp.gate_up_proj
    assert isinstance(gate_up, Fp8Linear)
    up = gate_up.dequantized_weight(torch.float32)[c.intermediate_size :]
    assert torch.equal(up, dequantized["model.layers.0.mlp.up_proj.weight"])


def test_flag_on_an_fp8_checkpoint_is_the_same_model(qwen3_tiny_dir: Path, tmp_path: Path) -> None:
    _fp8_checkpoint(qwen3_tiny_dir, tmp_path / "fp8")
    model = str(tmp_path / "fp8")
    a = load_model(EngineConfig(model=model, dtype="float32"), CPU).model
    b = load_model(EngineConfig(model=model, dtype="float32", quantization="fp8"), CPU).model
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x.float(), y.float()), name


def test_compressed_tensors_fp8_is_accepted(qwen3_tiny_dir: Path, tmp_path: Path) -> None:
    quant = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                                      "targets": ["Linear"]}},
        "ignore": ["lm_head"],
    }  # fmt: skip
    _fp8_checkpoint(qwen3_tiny_dir, tmp_path / "ct", quant)
    assert load_model(EngineConfig(model=str(tmp_path / "ct")), CPU).quantization == "fp8"


@pytest.mark.parametrize(
    ("quant", "match"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be two positive"),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, r"weight_block_size must be two positive"),
        ({"quant_method": "fp8", "weight_block_size": "128x128"}, r"weight_block_size must be two positive"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "mx"},
         "scale_fmt 'mx' is not supported; supported: float and ue8m0"),
        ({"quant_method": "fp8", "scale_fmt": "ue8m0"},
         "scale_fmt 'ue8m0': supported with weight_block_size only"),
        ({"quant_method": "compressed-tensors",
          "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "block"}}}},
         r"g\.weights\.block_structure must be two positive integers, got None"),
        ({"quant_method": "compressed-tensors",
          "config_groups": {
              "a": {"weights": {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]}},
              "b": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}},
         "groups with per-block scales and groups with other strategies"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]}, "unquantized module"),
        ({"quant_method": "compressed-tensors",
          "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}}},
         "8-bit float weights"),
    ],
)  # fmt: skip
def test_other_schemes_are_refused_by_field(
    qwen3_tiny_dir: Path, tmp_path: Path, quant: dict[str, Any], match: str
) -> None:
    target = tmp_path / "model"
    shutil.copytree(qwen3_tiny_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quant
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ParamError, match=match) as err:
        load_model(EngineConfig(model=str(target)), CPU)
    assert "quantization_config" in err.value.message


def test_unquantized_projection_in_an_fp8_checkpoint_is_refused(
    qwen3_tiny_dir: Path, tmp_path: Path
) -> None:
    _fp8_checkpoint(qwen3_tiny_dir, tmp_path / "fp8")
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(path))
    with pytest.raises(ParamError, match="down_proj.weight.*float32.*float8_e4m3fn"):
        load_model(EngineConfig(model=str(tmp_path / "fp8")), CPU)


def _nan_code_weight(t: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    codes = t[name].view(torch.uint8).clone()
    codes[3, 5] = 0xFF  # e4m3fn's negative NaN
    t[name] = codes.view(torch.float8_e4m3fn)


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(name, value(t[name]))


DOWN_SCALE = "model.layers.0.mlp.down_proj.weight_scale"
Q_SCALE = "model.layers.0.self_attn.q_proj.weight_scale"


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_set(DOWN_SCALE, lambda s: torch.full_like(s, float("nan"))), "down_proj.weight_scale' holds 64 negative or non-finite values \\(e.g. nan\\)"),
        (_set(Q_SCALE, lambda s: torch.tensor(float("inf"))), "q_proj.weight_scale' holds 1 negative or non-finite"),
        (_set(DOWN_SCALE, lambda s: -s), "down_proj.weight_scale' holds 64 negative"),
        (_set(DOWN_SCALE, lambda s: torch.ones_like(s, dtype=torch.int32)), "down_proj.weight_scale' is int32; expected a float tensor"),
        (_set(DOWN_SCALE, lambda s: s.to(torch.float8_e4m3fn)), "down_proj.weight_scale' is float8_e4m3fn; expected a float tensor"),
        (_nan_code_weight, "down_proj.weight' holds 1 NaN codes"),
    ],
    ids=["nan-scale", "inf-scale", "negative-scale", "int-scale", "fp8-scale", "nan-code"],
)  # fmt: skip
def test_damaged_fp8_tensors_are_refused_by_name(
    qwen3_tiny_dir: Path, tmp_path: Path, damage: Callable[[dict], None], match: str
) -> None:
    """Scales that are not finite non-negative floats and e4m3 NaN codes in a weight would make
    a projection's outputs NaN or flip them: the load names the tensor instead."""
    _fp8_checkpoint(qwen3_tiny_dir, tmp_path / "fp8")
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    damage(tensors)
    save_file(tensors, str(path))
    with pytest.raises(ParamError, match=match) as err:
        load_model(EngineConfig(model=str(tmp_path / "fp8"), dtype="float32"), CPU)
    assert str(tmp_path / "fp8") in err.value.message


def test_fp8_tensors_without_an_fp8_config_are_refused(
    qwen3_tiny_dir: Path, tmp_path: Path
) -> None:
    """FP8 codes whose config declares no FP8 quantization_config would be read as values
    without their scales: refused, naming the tensor (whichever comes first, a weight or a
    scale)."""
    _fp8_checkpoint(qwen3_tiny_dir, tmp_path / "fp8")
    config_path = tmp_path / "fp8" / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        ParamError,
        match="(is float8_e4m3fn where the model holds float32"
        "|weight_scale' for this model \\(an FP8 checkpoint's scale)",
    ):
        load_model(EngineConfig(model=str(tmp_path / "fp8"), dtype="float32"), CPU)
    # an FP8 LM head in a bf16/fp32 checkpoint: the codes never become the head's values
    plain = tmp_path / "plain"
    shutil.copytree(qwen3_tiny_dir, plain)
    tensors = load_file(str(plain / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    tensors[head] = tensors[head].to(torch.float8_e4m3fn)
    save_file(tensors, str(plain / "model.safetensors"))
    with pytest.raises(ParamError, match=f"'{head}' is float8_e4m3fn where the model holds"):
        load_model(EngineConfig(model=str(plain), dtype="float32"), CPU)


def test_zero_and_half_precision_scales_load(qwen3_tiny_dir: Path, tmp_path: Path) -> None:
    """A zero per-tensor scale (an all-zero projection) and bf16 per-channel scales are valid:
    the zero scale gives zero rows, the bf16 ones their float32 values."""
    _fp8_checkpoint(qwen3_tiny_dir, tmp_path / "fp8")
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    tensors[Q_SCALE] = torch.zeros(())
    tensors[DOWN_SCALE] = tensors[DOWN_SCALE].bfloat16()
    save_file(tensors, str(path))
    loaded = load_model(EngineConfig(model=str(tmp_path / "fp8"), dtype="float32"), CPU)
    layer = cast(LlamaDecoderLayer, loaded.model.model.layers[0])
    q_rows = layer.self_attn.qkv_proj.dequantized_weight(torch.float32)[: loaded.config.q_size]
    assert bool((q_rows == 0).all())
    down = layer.mlp.down_proj
    assert isinstance(down, Fp8Linear)
    assert torch.equal(down.weight_scale, tensors[DOWN_SCALE].float().flatten())


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_fp8_activation_schemes(qwen3_tiny_dir: Path, tmp_path: Path, scheme: str) -> None:
    """Both of vLLM's activation schemes load (static input scales read and not used); any
    other value is refused by field."""
    _fp8_checkpoint(qwen3_tiny_dir, tmp_path / "ok", {**FP8_CONFIG, "activation_scheme": scheme})
    assert load_model(EngineConfig(model=str(tmp_path / "ok")), CPU).quantization == "fp8"
    _fp8_checkpoint(
        qwen3_tiny_dir, tmp_path / "bad", {**FP8_CONFIG, "activation_scheme": scheme + "ish"}
    )
    with pytest.raises(ParamError, match=f"activation_scheme '{scheme}ish' is not supported"):
        load_model(EngineConfig(model=str(tmp_path / "bad")), CPU)


def _hf_weights(directory: Path) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(str(directory / "model.safetensors")).items())


def _with_projections(
    source: Path, convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """`source`'s tensors with every decoder projection's weight replaced by what `convert`
    (its name and tensor) gives."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _hf_weights(source):
        part = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        out.update(convert(name, tensor) if part in PROJECTIONS else {name: tensor})
    return out


@pytest.mark.parametrize(
    ("layout", "suffix"), [("fp8", ".weight_scale_inv"), ("compressed-tensors", ".weight_scale")]
)
def test_block_fp8_checkpoint_loads_with_channel_scales(
    qwen3_tiny_dir: Path, tmp_path: Path, layout: str, suffix: str
) -> None:
    """Blocks of 48 x 40 (ragged at every edge of the tiny shape): each projection's weight is
    the block conversion's, row for row inside the fused q/k/v and gate/up parameters, and the
    model computes what the checkpoint's own values compute, to the conversion's rounding."""
    config = load_model(EngineConfig(model=str(qwen3_tiny_dir), dtype="float32"), CPU).config
    write_block_fp8_checkpoint(config, _hf_weights(qwen3_tiny_dir), tmp_path / "blk", (48, 40),
                               layout, as_written=tmp_path / "written")  # fmt: skip
    written = load_file(str(tmp_path / "blk" / "model.safetensors"))
    assert "model.layers.0.mlp.down_proj" + suffix in written
    loaded = load_model(EngineConfig(model=str(tmp_path / "blk"), dtype="float32"), CPU)
    assert loaded.quantization == "fp8" and loaded.config.weight_blocks == WeightBlocks(
        48, 40, suffix
    )
    layer = cast(LlamaDecoderLayer, loaded.model.model.layers[1])
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear)
    c = loaded.config
    name = "model.layers.1.self_attn.k_proj"
    codes, channel = channel_scales_from_blocks(
        written[name + ".weight"], written[name + suffix], WeightBlocks(48, 40, suffix)
    )
    rows = slice(c.q_size, c.q_size + c.kv_size)
    assert torch.equal(qkv.weight.data[rows].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(qkv.weight_scale.data[rows], channel)

    reference = load_model(EngineConfig(model=str(tmp_path / "written"), dtype="float32"), CPU)
    for module_name, error in _projection_errors(loaded, reference).items():
        assert error < 0.06, module_name


def _projection_errors(loaded: Any, reference: Any) -> dict[str, float]:
    """Each projection of layer 1 of `loaded` against the same of `reference` on 13 random
    rows: the relative error of its output, by module name."""
    c = loaded.config
    gen = torch.Generator().manual_seed(1)
    inputs = {"self_attn.qkv_proj": c.hidden_size, "self_attn.o_proj": c.q_size,
              "mlp.gate_up_proj": c.hidden_size, "mlp.down_proj": c.intermediate_size}  # fmt: skip
    errors = {}
    with torch.no_grad():
        for module_name, width in inputs.items():
            ours = loaded.model.get_submodule(f"model.layers.1.{module_name}")
            theirs = reference.model.get_submodule(f"model.layers.1.{module_name}")
            x = torch.randn(13, width, generator=gen)
            want = theirs(x)
            errors[module_name] = float((ours(x) - want).norm() / want.norm())
    return errors


@pytest.mark.parametrize(
    ("block", "scale_fmt"), [((32, 32), "float"), ((32, 32), "ue8m0"), (None, "float")]
)
def test_block_fp8_checkpoint_written_by_transformers(
    qwen3_tiny_dir: Path, tmp_path: Path, block: tuple[int, int] | None, scale_fmt: str
) -> None:
    """A checkpoint whose projections transformers' own fine-grained FP8 quantizer wrote (its
    `weight_scale_inv` convention: a value is code x scale of its block) loads to weights
    within one e4m3 rounding of transformers' dequantization of the same tensors (with
    `scale_fmt: ue8m0` its scales are powers of two stored as float8_e8m0fnu); without a
    block size it writes one scale per tensor, which loads exactly."""
    try:
        from transformers.integrations.finegrained_fp8 import Fp8Quantize
        from transformers.utils.quantization_config import FineGrainedFP8Config
    except ImportError:
        unavailable("transformers without the fine-grained FP8 quantizer")
    import types

    quant_config = FineGrainedFP8Config(weight_block_size=block, scale_fmt=scale_fmt)
    quantizer = Fp8Quantize(types.SimpleNamespace(quantization_config=quant_config))
    target = tmp_path / "hf-blk"
    target.mkdir()
    out = _with_projections(qwen3_tiny_dir, lambda name, t: quantizer.convert({name: t}))
    save_file(out, str(target / "model.safetensors"))
    config = json.loads((qwen3_tiny_dir / "config.json").read_text())
    config["quantization_config"] = quant_config.to_dict()
    (target / "config.json").write_text(json.dumps(config))

    loaded = load_model(EngineConfig(model=str(target), dtype="float32"), CPU)
    assert loaded.quantization == "fp8"
    gate_up = cast(LlamaDecoderLayer, loaded.model.model.layers[0]).mlp.gate_up_proj
    assert isinstance(gate_up, Fp8Linear)
    name = "model.layers.0.mlp.up_proj"
    codes, scales = out[name + ".weight"], out[name + ".weight_scale_inv"]
    ours = gate_up.dequantized_weight(torch.float32)[loaded.config.intermediate_size :]
    if block is None:
        assert loaded.config.weight_blocks is None and scales.numel() == 1
        assert torch.equal(ours, codes.float() * scales.reshape(()))
        return
    power_of_two = scale_fmt == "ue8m0"
    assert loaded.config.weight_blocks == WeightBlocks(32, 32, ".weight_scale_inv", power_of_two)
    assert scales.dtype == (torch.float8_e8m0fnu if power_of_two else torch.float32)
    scales = scales.float()
    theirs = codes.float() * scales.repeat_interleave(32, 0).repeat_interleave(32, 1)
    step = torch.maximum(theirs.abs() * 2.0**-3, gate_up.weight_scale.data[
        loaded.config.intermediate_size :, None] * 2.0**-9)  # fmt: skip
    assert bool(((ours - theirs).abs() <= step / 2 * (1 + 1e-5)).all())
    assert float((ours - theirs).norm() / theirs.norm()) < 0.05


def _modelopt_checkpoint(source: Path, target: Path, algo: str, legacy: bool) -> dict[str, Any]:
    """`source` as a ModelOpt FP8 export (the layouts vLLM 0.33.0's wheel reads): `weight` in
    e4m3 and a float32 `weight_scale`, one value (FP8), [N] (FP8_PER_CHANNEL_PER_TOKEN) or
    [ceil(N / 128), ceil(K / 128)] (FP8_PB_WO); a static `input_scale`; KV scales on k_proj and
    v_proj. Its settings in config.json's quantization_config, or (`legacy`) in
    hf_quant_config.json beside a config.json without one. Returns the written tensors."""
    target.mkdir()

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        stem = name.removesuffix(".weight")
        if algo.upper() == "FP8_PB_WO":
            codes, scale = block_quantize(tensor, 128, 128)
        else:
            per_channel = algo.upper() == "FP8_PER_CHANNEL_PER_TOKEN"
            amax = tensor.abs().amax(dim=1) if per_channel else tensor.abs().amax()
            scale = (amax / 448).float()
            codes = (tensor / (scale[:, None] if per_channel else scale)).to(torch.float8_e4m3fn)
        out = {
            name: codes,
            f"{stem}.weight_scale": scale,
            f"{stem}.input_scale": torch.tensor(0.02),
        }
        part = stem.rsplit(".", 1)[-1]
        if part in ("k_proj", "v_proj"):  # ModelOpt's KV scales sit on k_proj and v_proj
            out[f"{stem}.{part[0]}_scale"] = torch.tensor(0.5)
        return out

    out = _with_projections(source, convert)
    save_file(out, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    settings = {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    if legacy:
        producer = {"name": "modelopt", "version": "0.29.0"}
        (target / "hf_quant_config.json").write_text(
            json.dumps({"producer": producer, "quantization": settings})
        )
    else:
        config["quantization_config"] = {"quant_method": "modelopt", **settings}
    (target / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("legacy", [False, True], ids=["config.json", "hf_quant_config.json"])
@pytest.mark.parametrize("algo", ["FP8", "fp8_per_channel_per_token", "FP8_PB_WO"])
def test_modelopt_fp8_exports_load(
    qwen3_tiny_dir: Path, tmp_path: Path, algo: str, legacy: bool
) -> None:
    """Each projection holds the export's codes and scales (per tensor: its rows of the fused
    scale; per block: the block conversion's), detected without the flag."""
    written = _modelopt_checkpoint(qwen3_tiny_dir, tmp_path / "mo", algo, legacy)
    loaded = load_model(EngineConfig(model=str(tmp_path / "mo"), dtype="float32"), CPU)
    assert loaded.quantization == "fp8"
    blocks = WeightBlocks(128, 128, ".weight_scale") if algo == "FP8_PB_WO" else None
    assert loaded.config.weight_blocks == blocks
    c = loaded.config
    for index in range(c.num_layers):
        layer = cast(LlamaDecoderLayer, loaded.model.model.layers[index])
        fused = {"q_proj": (layer.self_attn.qkv_proj, 0, c.q_size),
                 "k_proj": (layer.self_attn.qkv_proj, c.q_size, c.kv_size),
                 "v_proj": (layer.self_attn.qkv_proj, c.q_size + c.kv_size, c.kv_size),
                 "o_proj": (layer.self_attn.o_proj, 0, c.hidden_size),
                 "gate_proj": (layer.mlp.gate_up_proj, 0, c.intermediate_size),
                 "up_proj": (layer.mlp.gate_up_proj, c.intermediate_size, c.intermediate_size),
                 "down_proj": (layer.mlp.down_proj, 0, c.hidden_size)}  # fmt: skip
        for part, (module, start, size) in fused.items():
            assert isinstance(module, Fp8Linear)
            group = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"model.layers.{index}.{group}.{part}"
            codes, scale = written[f"{stem}.weight"], written[f"{stem}.weight_scale"]
            if blocks is not None:
                codes, scale = channel_scales_from_blocks(codes, scale, blocks)
            rows = slice(start, start + size)
            assert torch.equal(module.weight.data[rows].view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(module.weight_scale.data[rows], scale.float().expand(size)), stem


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"quant_algo": "NVFP4"}, r"quant_algo 'NVFP4' is not supported; supported for ModelOpt"),
        ({"quant_algo": "MIXED_PRECISION"}, r"quant_algo 'MIXED_PRECISION' is not supported"),
        ({}, r"quant_algo None is not supported"),
        ({"quant_algo": "FP8", "exclude_modules": ["*self_attn*", "lm_head"]},
         r"exclude_modules: '\*self_attn\*' leaves model\.layers\.0\.self_attn\.q_proj unquantized"),
        ({"quant_algo": "FP8", "exclude_modules": ["model.layers.1.mlp"]},
         r"'model\.layers\.1\.mlp' leaves model\.layers\.1\.mlp\.gate_proj unquantized"),
        ({"quant_algo": "FP8", "exclude_modules": "lm_head"}, "must be a list of module names"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("legacy", [False, True], ids=["config.json", "hf_quant_config.json"])
def test_modelopt_exports_refused_by_field(
    qwen3_tiny_dir: Path, tmp_path: Path, settings: dict[str, Any], match: str, legacy: bool
) -> None:
    """What this engine cannot serve is refused at load, naming the file and the key: other
    ModelOpt formats, and exclusions that leave a decoder projection unquantized."""
    target = tmp_path / "model"
    shutil.copytree(qwen3_tiny_dir, target)
    if legacy:
        quant = {"producer": {"name": "modelopt"}, "quantization": settings}
        (target / "hf_quant_config.json").write_text(json.dumps(quant))
        where = "hf_quant_config.json"
    else:
        config = json.loads((target / "config.json").read_text())
        renamed = {"ignore" if k == "exclude_modules" else k: v for k, v in settings.items()}
        config["quantization_config"] = {"quant_method": "modelopt", **renamed}
        (target / "config.json").write_text(json.dumps(config))
        where = "config.json: quantization_config"
        match = match.replace("exclude_modules", "ignore")
    with pytest.raises(ParamError, match=match) as err:
        load_model(EngineConfig(model=str(target)), CPU)
    assert where in err.value.message


def test_fbgemm_fp8_checkpoint_loads(qwen3_tiny_dir: Path, tmp_path: Path) -> None:
    """transformers' fbgemm FP8 layout (its FbgemmFp8Linear: `weight_scale` float32 [N, 1]),
    with the quantization_config its FbgemmFp8Config writes; a module other than lm_head left
    unquantized is refused by field."""
    try:
        from transformers.utils.quantization_config import FbgemmFp8Config
    except ImportError:
        unavailable("transformers without FbgemmFp8Config")
    quant = FbgemmFp8Config(modules_to_not_convert=["lm_head"]).to_dict()
    assert quant["quant_method"] == "fbgemm_fp8"
    target = tmp_path / "fbgemm"
    target.mkdir()

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = (tensor.abs().amax(dim=1, keepdim=True) / 448).float()  # [N, 1]
        codes = (tensor / scale).to(torch.float8_e4m3fn)
        return {name: codes, name.replace(".weight", ".weight_scale"): scale}

    out = _with_projections(qwen3_tiny_dir, convert)
    save_file(out, str(target / "model.safetensors"))
    config = json.loads((qwen3_tiny_dir / "config.json").read_text())
    config["quantization_config"] = quant
    (target / "config.json").write_text(json.dumps(config))
    loaded = load_model(EngineConfig(model=str(target), dtype="float32"), CPU)
    assert loaded.quantization == "fp8"
    down = cast(LlamaDecoderLayer, loaded.model.model.layers[1]).mlp.down_proj
    assert isinstance(down, Fp8Linear)
    name = "model.layers.1.mlp.down_proj"
    want = out[name + ".weight"].float() * out[name + ".weight_scale"]
    assert torch.equal(down.dequantized_weight(torch.float32), want)

    config["quantization_config"] = FbgemmFp8Config(
        modules_to_not_convert=["lm_head", "model.layers.0.self_attn.o_proj"]
    ).to_dict()
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ParamError, match="unquantized module 'model.layers.0.self_attn.o_proj'"):
        load_model(EngineConfig(model=str(target)), CPU)


def test_a_modelopt_fp8_kv_declaration_is_reported_not_applied(
    qwen3_tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`kv_cache_quant_algo: FP8` (written by `_modelopt_checkpoint`) leaves the cache in the
    model dtype unless --kv-cache-dtype fp8 asks for it, and the load says so."""
    _modelopt_checkpoint(qwen3_tiny_dir, tmp_path / "mo", "FP8", legacy=True)
    with caplog.at_level("INFO", logger="davit_engine.loader"):
        loaded = load_model(EngineConfig(model=str(tmp_path / "mo"), dtype="float32"), CPU)
    assert loaded.config.declares_fp8_kv and loaded.kv_cache_dtype != "fp8"
    assert "declares an FP8 KV cache" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="davit_engine.loader"):
        fp8 = load_model(
            EngineConfig(model=str(tmp_path / "mo"), dtype="float32", kv_cache_dtype="fp8"), CPU
        )
    assert fp8.kv_cache_dtype == "fp8" and "declares an FP8 KV cache" not in caplog.text


@pytest.mark.parametrize(
    ("block", "layout"), [((32, 32), "fp8"), ((48, 128), "fp8"), ((32, 32), "compressed-tensors")]
)
def test_block_fp8_checkpoint_served_with_its_own_scales(
    qwen3_tiny_dir: Path, tmp_path: Path, block: tuple[int, int], layout: str
) -> None:
    """`--fp8-block-scales native`: the codes load as written, each block scale repeated over
    its block's rows inside the fused q/k/v and gate/up parameters, and every projection
    computes what the checkpoint's own values compute, to float32 summation (few rows: the
    weight-only product; 48 x 128 blocks are ragged in rows and wider than K)."""
    from davit_engine.quant.fp8_block_linear import Fp8BlockLinear

    config = load_model(EngineConfig(model=str(qwen3_tiny_dir), dtype="float32"), CPU).config
    write_block_fp8_checkpoint(config, _hf_weights(qwen3_tiny_dir), tmp_path / "blk", block,
                               layout, as_written=tmp_path / "written")  # fmt: skip
    suffix = ".weight_scale_inv" if layout == "fp8" else ".weight_scale"
    written = load_file(str(tmp_path / "blk" / "model.safetensors"))
    native = EngineConfig(model=str(tmp_path / "blk"), dtype="float32", fp8_block_scales="native")
    loaded = load_model(native, CPU)
    layer = cast(LlamaDecoderLayer, loaded.model.model.layers[1])
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, Fp8BlockLinear) and qkv.group == block[1]
    assert loaded.fp8_block_scales == "native"  # in the memory profile's identity
    c = loaded.config
    name = "model.layers.1.self_attn.k_proj"
    rows = slice(c.q_size, c.q_size + c.kv_size)
    assert torch.equal(qkv.weight.data[rows].view(torch.uint8),
                       written[name + ".weight"].view(torch.uint8))  # fmt: skip
    expanded = written[name + suffix].float().repeat_interleave(block[0], dim=0)[: c.kv_size]
    assert torch.equal(qkv.weight_scale.data[rows], expanded)

    reference = load_model(EngineConfig(model=str(tmp_path / "written"), dtype="float32"), CPU)
    for module_name, error in _projection_errors(loaded, reference).items():
        assert error < 1e-6, module_name
    # the default re-quantizes to channel scales, as before
    channel = load_model(EngineConfig(model=str(tmp_path / "blk"), dtype="float32"), CPU)
    assert channel.fp8_block_scales == "channel"
    assert isinstance(cast(LlamaDecoderLayer, channel.model.model.layers[1]).self_attn.qkv_proj,
                      Fp8Linear)  # fmt: skip


def test_native_block_scales_need_whole_groups_on_every_rank() -> None:
    """Under tensor parallelism each rank's input columns of o_proj and down_proj must hold
    whole groups of scales; otherwise the flag is named before anything loads."""
    from davit_engine.loader import check_tensor_parallel, native_block_scales
    from davit_engine.shapes import get_shape

    shape = dataclasses.replace(
        get_shape("qwen3-tiny"), quantization="fp8", weight_blocks=WeightBlocks(32, 128, ".s")
    )
    native = EngineConfig(model="x", fp8_block_scales="native", tensor_parallel_size=2)
    with pytest.raises(ParamError) as info:
        native_block_scales(native, shape, "safetensors")
    assert info.value.param == "--fp8-block-scales" and "o_proj" in info.value.message
    with pytest.raises(ParamError, match="o_proj"):  # the engine's check before ranks start
        check_tensor_parallel(dataclasses.replace(native, model="/m"), shape)
    odd = dataclasses.replace(shape, weight_blocks=WeightBlocks(32, 40, ".s"))
    with pytest.raises(ParamError, match="40 columns wide"):  # no Triton product takes it
        native_block_scales(dataclasses.replace(native, tensor_parallel_size=1), odd, "safetensors")
    whole = dataclasses.replace(shape, weight_blocks=WeightBlocks(32, 32, ".s"))
    assert native_block_scales(native, whole, "safetensors") == WeightBlocks(32, 32, ".s")
    assert native_block_scales(dataclasses.replace(native, fp8_block_scales="channel"), whole,
                               "safetensors") is None  # fmt: skip
    with pytest.raises(ParamError, match="--fp8-block-scales|channel, native"):
        EngineConfig(model="x", fp8_block_scales="blocks").validate()


@pytest.mark.parametrize(
    ("runner", "device"), [("v1", "cpu"), pytest.param("v2", "cuda", marks=pytest.mark.gpu)]
)
def test_native_block_scales_generate_the_checkpoints_tokens(
    qwen3_tiny_dir: Path, tmp_path: Path, runner: str, device: str
) -> None:
    """Through the engine (chunked prefill, decode; on a GPU runner V2 with its CUDA graphs): a
    block checkpoint served with its own scales greedily generates the tokens of its values
    stored in float32."""
    from davit_engine.llm import LLM
    from davit_engine.types import SamplingParams

    config = load_model(EngineConfig(model=str(qwen3_tiny_dir), dtype="float32"), CPU).config
    write_block_fp8_checkpoint(config, _hf_weights(qwen3_tiny_dir), tmp_path / "blk", (32, 32),
                               as_written=tmp_path / "written")  # fmt: skip
    prompts = [[1, 5, 9, 33, 200, 7, 8, 100, 101, 102, 17, 18, 19, 20, 21, 22, 23, 24], [3, 4]]
    tokens = {}
    for name, scales in (("written", "channel"), ("blk", "native")):
        llm = LLM(str(tmp_path / name), tokenizer="byte", dtype="float32", device=device,
                  runner=runner, max_num_batched_tokens=8, max_model_len=128,
                  fp8_block_scales=scales)  # fmt: skip
        try:
            outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
            tokens[name] = [o.token_ids for o in outputs]
        finally:
            llm.shutdown()
    assert tokens["blk"] == tokens["written"] and len(tokens["blk"][0]) == 10
