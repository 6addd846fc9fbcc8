"""Hugging Face `config.json` <-> `ModelConfig` for the Llama, Qwen2 and Qwen3 model types."""

from __future__ import annotations

import dataclasses
from fnmatch import fnmatchcase
from typing import Any

from davit_engine.models.config import (
    ARCHITECTURES,
    DECODER_PROJECTIONS,
    ModelConfig,
    WeightBlocks,
)
from davit_engine.types import ParamError

# Which model_type values map to which composition, and what each implies beyond config.json.
MODEL_TYPES: dict[str, dict[str, Any]] = {
    "llama": {"architecture": "llama", "attention_bias": None, "qk_norm": False},
    "qwen2": {"architecture": "qwen2", "attention_bias": True, "qk_norm": False},
    "qwen3": {"architecture": "qwen3", "attention_bias": None, "qk_norm": True},
}


def model_config_from_hf(
    raw: dict[str, Any], source: str, quantization_source: str | None = None
) -> ModelConfig:
    """Parse a config.json dict; `source` (the file path) is named in every error, and
    `quantization_source` in those about its quantization_config where that came from another
    file (ModelOpt's hf_quant_config.json)."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ParamError(
            "model",
            f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}",
        )
    implied = MODEL_TYPES[model_type]

    def need(key: str) -> Any:
        if key not in raw:
            raise ParamError("model", f"{source}: required field {key!r} is missing")
        return raw[key]

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    # transformers 5 folds rope_theta/rope_scaling into rope_parameters; older files keep both.
    rope_params = raw.get("rope_parameters") or {}
    rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = raw.get("rope_scaling") or (
        {k: v for k, v in rope_params.items() if k != "rope_theta"} or None
    )
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    attention_bias = implied["attention_bias"]
    config = ModelConfig(
        architecture=implied["architecture"],
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or (hidden // heads if isinstance(hidden, int) else 0),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=(
            bool(raw.get("attention_bias", False)) if attention_bias is None else attention_bias
        ),
        qk_norm=implied["qk_norm"],
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )
    quantization, weight_blocks = checkpoint_quantization(
        raw.get("quantization_config"),
        quantization_source or f"{source}: quantization_config",
        config.num_layers,
    )
    config = dataclasses.replace(
        config,
        quantization=quantization,
        weight_blocks=weight_blocks,
        declares_fp8_kv=declares_fp8_kv(raw.get("quantization_config")),
    )
    config.validate(source)
    return config


# `activation_scheme` values of `quant_method: fp8` (the values vLLM 0.33.0's Fp8Config takes,
# read in its wheel). Missing means dynamic here; vLLM requires the key.
FP8_ACTIVATION_SCHEMES = ("static", "dynamic")


def checkpoint_quantization(
    quant: Any, field: str, num_layers: int = 0
) -> tuple[str | None, WeightBlocks | None]:
    """("fp8", blocks) for FP8 checkpoints in the common safetensors layouts (float8_e4m3fn
    projection weights with a per-tensor, per-channel or per-block scale beside each; `blocks`
    None unless per block: `quant_method: fp8` with `weight_block_size`, scales in
    `weight_scale_inv`; compressed-tensors' block strategy or ModelOpt's FP8_PB_WO, scales in
    `weight_scale`), (None, None) without a quantization_config; ParamError naming the field
    for any other scheme or a malformed block size. `num_layers` is the model's, for ModelOpt's
    module patterns (each checked against every decoder projection's name). `field` names the
    object in errors."""
    if quant is None:
        return None, None
    if not isinstance(quant, dict):
        raise ParamError("model", f"{field} must be an object")
    if _is_modelopt(quant):
        return "fp8", _modelopt_weights(quant, field, num_layers)
    method = quant.get("quant_method")
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ParamError("model", f"{field}.fmt {quant['fmt']!r}: only e4m3 is supported")
        scheme = quant.get("activation_scheme", "dynamic")
        if scheme not in FP8_ACTIVATION_SCHEMES:
            # vLLM 0.33.0 refuses the same (quantization/fp8.py, ACTIVATION_SCHEMES)
            raise ParamError(
                "model",
                f"{field}.activation_scheme {scheme!r} is not supported; supported: "
                f"{', '.join(FP8_ACTIVATION_SCHEMES)} (activations are quantized per token "
                "either way: static input scales are read and not used)",
            )
        _check_ignored(quant.get("ignored_layers") or quant.get("modules_to_not_convert"), field)
        return "fp8", _fp8_weight_blocks(quant, field)
    if method == "fbgemm_fp8":
        # transformers' FbgemmFp8Linear: `weight` e4m3 [N, K], `weight_scale` float32 [N, 1]
        # (transformers 5.25); `activation_scale_ub` bounds static activation scales, which
        # are not used here (activations are quantized per token)
        _check_ignored(quant.get("modules_to_not_convert"), field)
        return "fp8", None
    if method == "compressed-tensors":
        blocks = _compressed_tensors_weights(quant, field)
        _check_ignored(quant.get("ignore"), field)
        return "fp8", blocks
    raise ParamError(
        "model",
        f"{field}.quant_method {method!r} is not supported; supported: fp8, fbgemm_fp8, "
        "compressed-tensors FP8 and modelopt FP8 (float8_e4m3fn weights with per-tensor, "
        "per-channel or per-block scales)",
    )


def _fp8_weight_blocks(quant: dict[str, Any], field: str) -> WeightBlocks | None:
    size = quant.get("weight_block_size")
    scale_fmt = quant.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise ParamError(
            "model",
            f"{field}.scale_fmt {scale_fmt!r} is not supported; supported: float and ue8m0",
        )
    if size is None:
        if scale_fmt == "ue8m0":
            raise ParamError(
                "model", f"{field}.scale_fmt 'ue8m0': supported with weight_block_size only"
            )
        return None
    rows, cols = _block_size(size, f"{field}.weight_block_size")
    return WeightBlocks(rows, cols, ".weight_scale_inv", power_of_two=scale_fmt == "ue8m0")


def _block_size(size: Any, field: str) -> tuple[int, int]:
    if (
        not isinstance(size, list | tuple)
        or len(size) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
    ):
        raise ParamError("model", f"{field} must be two positive integers, got {size!r}")
    return int(size[0]), int(size[1])


def _compressed_tensors_weights(quant: dict[str, Any], field: str) -> WeightBlocks | None:
    """Check that every config group quantizes weights to 8-bit floats per tensor, per channel
    or per block (one block structure for all); the blocks, or None."""
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ParamError("model", f"{field}.config_groups: expected at least one group")
    blocks: set[tuple[int, int] | None] = set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        strategy = weights.get("strategy")
        if (
            weights.get("type") != "float"
            or weights.get("num_bits") != 8
            or strategy not in ("tensor", "channel", "block")
        ):
            raise ParamError(
                "model",
                f"{field}.config_groups.{name}.weights: only 8-bit float weights with a "
                f"tensor, channel or block strategy (FP8) are supported, got {weights!r}",
            )
        blocks.add(
            _block_size(
                weights.get("block_structure"),
                f"{field}.config_groups.{name}.weights.block_structure",
            )
            if strategy == "block"
            else None
        )
    if len(blocks) > 1:
        raise ParamError(
            "model",
            f"{field}.config_groups: groups with per-block scales and groups with other "
            "strategies or block structures in one checkpoint are not supported",
        )
    size = blocks.pop()
    return None if size is None else WeightBlocks(size[0], size[1], ".weight_scale")


# ModelOpt's FP8 layouts by `quant_algo` (its case does not matter): the block size of the
# weight scales, None for one scale per tensor (FP8) or per output channel
# (FP8_PER_CHANNEL_PER_TOKEN). The names and layouts are those vLLM 0.33.0's wheel reads
# (model_executor/layers/quantization/modelopt.py): `weight` float8_e4m3fn [N, K] and
# `weight_scale` float32, one value, [N] or [ceil(N / 128), ceil(K / 128)]; a static
# `input_scale` beside them (not used here: activations are quantized per token).
MODELOPT_FP8_ALGOS: dict[str, tuple[int, int] | None] = {
    "FP8": None,
    "FP8_PER_CHANNEL_PER_TOKEN": None,
    "FP8_PB_WO": (128, 128),
}


def _is_modelopt(quant: dict[str, Any]) -> bool:
    """A ModelOpt export: `quant_method` modelopt (any case, modelopt_fp4 and the like too), or
    its producer named modelopt (hf_quant_config.json, which ModelOpt wrote beside config.json
    before it wrote quantization_config into it)."""
    method = quant.get("quant_method")
    producer = quant.get("producer")
    return (isinstance(method, str) and method.lower().startswith("modelopt")) or (
        isinstance(producer, dict) and producer.get("name") == "modelopt"
    )


def _modelopt_weights(quant: dict[str, Any], field: str, num_layers: int) -> WeightBlocks | None:
    """The FP8 layout of a ModelOpt export. Its settings are either under `quantization`
    (`quant_algo`, `exclude_modules`: hf_quant_config.json's form) or at the top (`quant_algo`,
    `ignore` or `exclude_modules`)."""
    settings, where = _modelopt_settings(quant, field)
    algo = settings.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in MODELOPT_FP8_ALGOS:
        raise ParamError(
            "model",
            f"{where}.quant_algo {algo!r} is not supported; supported for ModelOpt exports: "
            f"{', '.join(MODELOPT_FP8_ALGOS)} (FP8 weights per tensor, per channel or per "
            "128 x 128 block)",
        )
    key = "ignore" if settings is quant and "ignore" in settings else "exclude_modules"
    _check_excluded(settings.get(key), f"{where}.{key}", num_layers)
    size = MODELOPT_FP8_ALGOS[algo.upper()]
    return None if size is None else WeightBlocks(size[0], size[1], ".weight_scale")


def _modelopt_settings(quant: dict[str, Any], field: str) -> tuple[dict[str, Any], str]:
    """A ModelOpt export's settings and their name in errors: the object under `quantization`
    (hf_quant_config.json's form) where there is one, else `quant` itself."""
    nested = quant.get("quantization")
    if nested is None:
        return quant, field
    if not isinstance(nested, dict):
        raise ParamError("model", f"{field}.quantization must be an object")
    return nested, f"{field}.quantization"


def declares_fp8_kv(quant: Any) -> bool:
    """Whether a ModelOpt export declares an FP8 KV cache: `kv_cache_quant_algo` FP8 (any case,
    at the top or under `quantization`) or a `kv_cache_scheme` of 8-bit floats, the forms
    vLLM 0.33.0 reads (utils/torch_utils.py)."""
    if not isinstance(quant, dict) or not _is_modelopt(quant):
        return False
    nested = quant.get("quantization")
    for settings in (nested if isinstance(nested, dict) else {}, quant):
        scheme = settings.get("kv_cache_scheme")
        if isinstance(scheme, dict):
            return scheme.get("type") == "float" and scheme.get("num_bits") == 8
        algo = settings.get("kv_cache_quant_algo")
        if isinstance(algo, str):
            return algo.lower() == "fp8"
    return False


def _check_excluded(patterns: Any, field: str, num_layers: int) -> None:
    """ModelOpt's exclusions are module names, substrings of them or wildcard patterns (the
    three ways vLLM 0.33.0 matches them); none may reach a decoder projection, which this
    engine loads as FP8 only."""
    if patterns is None:
        return
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ParamError("model", f"{field} must be a list of module names or patterns")
    for pattern in patterns:
        for layer in range(num_layers):
            for projection in DECODER_PROJECTIONS:
                name = f"model.layers.{layer}.{projection}"
                if pattern in name or fnmatchcase(name, pattern):
                    raise ParamError(
                        "model",
                        f"{field}: {pattern!r} leaves {name} unquantized; this engine loads "
                        "every decoder projection as FP8 (only lm_head may be left out)",
                    )


def _check_ignored(ignored: Any, field: str) -> None:
    """Only the LM head may stay unquantized: every decoder projection loads as FP8."""
    for name in ignored or []:
        if not (isinstance(name, str) and name.endswith("lm_head")):
            raise ParamError(
                "model",
                f"{field}: unquantized module {name!r}; this engine loads every decoder "
                "projection as FP8 (only lm_head may be left out)",
            )


def model_config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json transformers needs to build the same model (used for random weights)."""
    assert config.architecture in ARCHITECTURES
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    raw: dict[str, Any] = {
        "architectures": [names[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": config.torch_dtype or "float32",
    }
    if config.rope_scaling:
        raw["rope_scaling"] = dict(config.rope_scaling)
    if config.architecture != "qwen2":
        raw["attention_bias"] = config.attention_bias
    if config.bos_token_id is not None:
        raw["bos_token_id"] = config.bos_token_id
    if config.eos_token_ids:
        raw["eos_token_id"] = (
            config.eos_token_ids[0]
            if len(config.eos_token_ids) == 1
            else list(config.eos_token_ids)
        )
    return raw
