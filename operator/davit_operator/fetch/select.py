"""Which files of a model repository the engines need: weights, config, tokenizer, chat
template. Everything else (READMEs, other formats, ONNX or GGUF exports, training logs) stays
at the source."""

from __future__ import annotations

from collections.abc import Iterable

# Files at the repository root that serving reads besides the weights.
NEEDED_NAMES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "hf_quant_config.json",  # ModelOpt exports' quantization settings, beside config.json
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
    }
)


def is_needed(path: str) -> bool:
    """A root-level safetensors weight file or one of `NEEDED_NAMES`."""
    if "/" in path:
        return False
    return path in NEEDED_NAMES or path.endswith(".safetensors")


def needed(paths: Iterable[str]) -> list[str]:
    """The needed paths, sorted."""
    return sorted(p for p in paths if is_needed(p))


def has_weights(paths: Iterable[str]) -> bool:
    return any(p.endswith(".safetensors") for p in paths)
