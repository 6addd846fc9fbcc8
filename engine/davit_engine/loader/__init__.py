"""Model loading: Hugging Face safetensors directories, GGUF files and random weights.

`load_model(config, device)` returns a `LoadedModel`: the module with weights in place on
`device`, its `ModelConfig` and the dtype picked. Every failure is a ParamError naming the file
or field so `davit serve` can say exactly what to fix.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from davit_engine.config import EngineConfig
from davit_engine.layers.rotary import RotaryEmbedding
from davit_engine.loader import gguf_file, safetensors_dir
from davit_engine.loader.random_weights import fill_random
from davit_engine.models.config import ModelConfig
from davit_engine.models.llama import LlamaForCausalLM
from davit_engine.shapes import get_shape
from davit_engine.types import ParamError

logger = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    dtype: torch.dtype
    source: str  # "gguf", "safetensors" or "random"

    @property
    def num_parameters(self) -> int:
        return self.config.num_parameters()


def model_kind(model: str) -> str:
    """ "random", "gguf" or "safetensors" for a --model value (no file access for random)."""
    if model.startswith(RANDOM_PREFIX):
        return "random"
    if model.endswith(".gguf"):
        return "gguf"
    return "safetensors"


def read_model_config(model: str) -> ModelConfig:
    """The architecture of a --model value without loading its weights."""
    kind = model_kind(model)
    if kind == "random":
        return get_shape(model.removeprefix(RANDOM_PREFIX))
    path = Path(model)
    if kind == "gguf":
        return gguf_file.read_config(path)
    if not path.exists():
        raise ParamError("model", f"{model}: no such file or directory")
    if not path.is_dir():
        raise ParamError(
            "model", f"{model}: expected a Hugging Face directory, a .gguf file or random:<shape>"
        )
    return safetensors_dir.read_config(path)


def resolve_dtype(
    requested: str, kind: str, config: ModelConfig, device: torch.device
) -> torch.dtype:
    if requested != "auto":
        if requested not in DTYPES:
            raise ParamError(
                "--dtype", f"must be one of auto, {', '.join(DTYPES)}; got {requested!r}"
            )
        return DTYPES[requested]
    if kind == "safetensors" and config.torch_dtype in DTYPES:
        checkpoint = DTYPES[str(config.torch_dtype)]
        # Half precision on CPU is slow and lossy for no gain in memory we need.
        return checkpoint if device.type != "cpu" else torch.float32
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The module with uninitialised weights of `dtype` on `device` (no default init cost)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty() gives the shared weight one fresh tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_tables(device)
    return model.eval()


def load_model(config: EngineConfig, device: torch.device) -> LoadedModel:
    kind = model_kind(config.model)
    weights: Iterable[tuple[str, torch.Tensor]] | None = None
    if kind == "gguf":
        model_config, weights = gguf_file.load(Path(config.model))
    else:
        model_config = read_model_config(config.model)
    dtype = resolve_dtype(config.dtype, kind, model_config, device)
    model = build_empty(model_config, dtype, device)
    with torch.no_grad():
        if kind == "random":
            fill_random(model, config.seed)
        elif kind == "gguf":
            assert weights is not None
            model.load_weights(weights, config.model)
        else:
            model.load_weights(safetensors_dir.iter_weights(Path(config.model)), config.model)
    logger.info(
        "loaded %s (%s, %s, %.1fM parameters) as %s on %s",
        config.model,
        kind,
        model_config.architecture,
        model_config.num_parameters() / 1e6,
        dtype,
        device,
    )
    return LoadedModel(
        model=model,
        config=dataclasses.replace(model_config, torch_dtype=str(dtype).removeprefix("torch.")),
        dtype=dtype,
        source=kind,
    )
