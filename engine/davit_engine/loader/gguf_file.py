"""GGUF files: architecture metadata and tensors, dequantized with the `gguf` package.

Tensors are renamed to Hugging Face names (the table below) and, for the llama architecture,
q/k projection rows are permuted back: the GGUF converter interleaves the two rotary halves of
each head for llama.cpp's rotary layout, and our rotary embedding uses the Hugging Face one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from davit_engine.models.config import ModelConfig
from davit_engine.types import ParamError

# GGUF tensor name (per-layer part after `blk.N.`) -> Hugging Face name (after `model.layers.N.`)
LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Architectures whose GGUF converter permuted the q/k rows (see module docstring).
PERMUTED_QK = ("llama",)

_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def _open(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise ParamError("model", f"{path}: GGUF file not found")
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ParamError("model", f"{path}: not a readable GGUF file: {exc}") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_config(path: Path) -> ModelConfig:
    reader = _open(path)
    return _config_from_reader(reader, path)


def _config_from_reader(reader: Any, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ParamError(
            "model",
            f"{path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ParamError("model", f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ParamError("model", f"{path}: GGUF metadata has neither vocab_size nor tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    rope_scaling = None
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        from gguf import dequantize

        factors = dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1).tolist()
        rope_scaling = {"rope_type": "freq_factors", "factors": factors}
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )
    config.validate(str(path))
    return config


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors we do not use."""
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        mapped = LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{mapped}.{kind}" if mapped else None
    match = _GLOBAL_RE.match(gguf_name)
    if match:
        part, kind = match.groups()
        mapped = GLOBAL_NAMES.get(part)
        return f"{mapped}.{kind}" if mapped else None
    return None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the converter's per-head interleaving of the two rotary halves (rows of q/k)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # Converter layout per head: [half, 2, ...] (pairs interleaved); ours: [2, half, ...].
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def load(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Config plus a lazy iterator of (Hugging Face name, float32 tensor)."""
    reader = _open(path)
    config = _config_from_reader(reader, path)
    return config, _iter_tensors(reader, config)


def _iter_tensors(reader: Any, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import dequantize

    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        weights = torch.from_numpy(
            np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        )
        if config.architecture in PERMUTED_QK and name.endswith("q_proj.weight"):
            weights = unpermute_qk(weights, config.num_heads)
        elif config.architecture in PERMUTED_QK and name.endswith("k_proj.weight"):
            weights = unpermute_qk(weights, config.num_kv_heads)
        yield name, weights
