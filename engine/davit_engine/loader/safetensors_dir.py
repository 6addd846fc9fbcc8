"""Hugging Face checkpoint directories: config.json plus one or more .safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from davit_engine.loader.hf_config import model_config_from_hf
from davit_engine.models.config import ModelConfig
from davit_engine.types import ParamError

# Where ModelOpt exports before it wrote quantization_config into config.json keep theirs.
MODELOPT_QUANT_CONFIG = "hf_quant_config.json"


def read_config(directory: Path) -> ModelConfig:
    """Parse `directory/config.json`, merging EOS ids from generation_config.json if present;
    without a quantization_config, hf_quant_config.json beside it (a ModelOpt export) is one."""
    path = directory / "config.json"
    if not path.is_file():
        raise ParamError(
            "model", f"{directory}: no config.json (not a Hugging Face model directory)"
        )
    raw = _json_object(path)
    quantization_source = None
    legacy = directory / MODELOPT_QUANT_CONFIG
    if raw.get("quantization_config") is None and legacy.is_file():
        raw["quantization_config"] = _json_object(legacy)
        quantization_source = f"{legacy}: $"  # errors name its keys as $.quantization...
    config = model_config_from_hf(raw, str(path), quantization_source)
    generation = directory / "generation_config.json"
    if generation.is_file():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as exc:
            raise ParamError("model", f"{generation}: cannot be read as JSON: {exc}") from exc
        extra = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
        config = _replace(config, eos_token_ids=merged)
    return config


def _json_object(path: Path) -> dict[str, object]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ParamError("model", f"{path}: cannot be read as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ParamError("model", f"{path}: expected a JSON object")
    return raw


def weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ParamError("model", f"{directory}: no .safetensors weight files found")
    return files


def iter_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, tensor on CPU) for every tensor of every weight file."""
    for path in weight_files(directory):
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types; re-raise with the file
            raise ParamError("model", f"{path}: not a readable safetensors file: {exc}") from exc
        with handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle.get_tensor(name)


def _replace(config: ModelConfig, **changes: object) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]
