"""Random weights for a named shape, deterministic by seed, and saving them as a HF directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from davit_engine.loader.hf_config import model_config_to_hf
from davit_engine.models.config import ModelConfig
from davit_engine.models.llama import STACKED_PARAMS, LlamaForCausalLM

# Scale of the random projections: small enough that 30+ layers keep activations finite in fp16.
INIT_STD = 0.02


def fill_random(model: LlamaForCausalLM, seed: int) -> None:
    """Overwrite every parameter in place: norms ~ 1 + N(0, 0.1), matrices/biases ~ N(0, 0.02).

    Parameters are visited in name order with one generator on the model's device, so a seed
    gives the same weights on every run on the same kind of device.
    """
    params = dict(model.named_parameters())  # tied weights appear once
    device = next(iter(params.values())).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name in sorted(params):
            params[name].copy_(_random_values(name, params[name].shape, generator, device))


def _random_values(
    name: str, shape: torch.Size, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    scale, offset = (0.1, 1.0) if name.endswith("norm.weight") else (INIT_STD, 0.0)
    return offset + scale * values


def iter_random_weights(
    config: ModelConfig, seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights `fill_random` gives the whole model of `config`, as a checkpoint stream
    (Hugging Face names, float32 on `device`, fused parameters split back), one parameter at a
    time: a tensor-parallel rank cuts its part out of each without holding the whole model."""
    with torch.device("meta"):
        whole = LlamaForCausalLM(config)
    params = dict(whole.named_parameters())  # tied weights appear once, as in fill_random
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name in sorted(params):
            values = _random_values(name, params[name].shape, generator, device)
            fused = next((f for f, _, _ in STACKED_PARAMS if f".{f}." in name), None)
            if fused is None:
                yield name, values
                continue
            bounds = whole._shard_bounds(fused)
            for f, part, shard in STACKED_PARAMS:
                if f == fused:
                    yield (
                        name.replace(f".{fused}.", f".{part}."),
                        values[bounds[shard] : bounds[shard + 1]],
                    )


def save_hf_directory(model: LlamaForCausalLM, directory: Path) -> None:
    """Write config.json + model.safetensors (Hugging Face names) so other tools load it."""
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = param.detach().to("cpu").contiguous()
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)
        if fused is None:
            tensors[name] = data
            continue
        bounds = model._shard_bounds(fused)
        parts = ("q_proj", "k_proj", "v_proj") if fused == "qkv_proj" else ("gate_proj", "up_proj")
        for i, part in enumerate(parts):
            tensors[name.replace(f".{fused}.", f".{part}.")] = data[
                bounds[i] : bounds[i + 1]
            ].contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    raw = model_config_to_hf(config)
    raw["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
