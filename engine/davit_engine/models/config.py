"""`ModelConfig`: the architecture facts a model composition needs, whatever the checkpoint format."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from davit_engine.types import ParamError

Architecture = Literal["llama", "qwen2", "qwen3"]
ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")


# A decoder layer's projections by checkpoint name under `model.layers.<i>.`.
DECODER_PROJECTIONS: tuple[str, ...] = tuple(f"self_attn.{p}_proj" for p in "qkvo") + tuple(
    f"mlp.{p}_proj" for p in ("gate", "up", "down")
)


@dataclass(frozen=True)
class WeightBlocks:
    """How an FP8 checkpoint with block-wise scales stores them: one scale per `rows` x `cols`
    block of a projection's weight, in a tensor named `<projection><scale_suffix>` of shape
    `[ceil(N / rows), ceil(K / cols)]` (quant/block_fp8.py converts them at load)."""

    rows: int
    cols: int
    scale_suffix: str
    # Scales stored as powers of two, one byte each (`scale_fmt: ue8m0`): float8_e8m0fnu, or
    # its bytes as uint8 (`2^(b - 127)`); float tensors are read as they are.
    power_of_two: bool = False

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        n, k = weight_shape
        return math.ceil(n / self.rows), math.ceil(k / self.cols)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer of the Llama family.

    `attention_bias` is Qwen2's bias on the q/k/v projections; `qk_norm` is Qwen3's RMSNorm on
    each query and key head before the rotary embedding.
    """

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str | None = None  # the checkpoint's dtype name, used by dtype="auto"
    # How the checkpoint's projections are stored: None (the model dtype) or "fp8" (float8
    # e4m3 weights with scale tensors, from config.json's quantization_config).
    quantization: str | None = None
    # An FP8 checkpoint whose scales are per block of each weight (None: per tensor or per
    # output channel, `weight_scale`).
    weight_blocks: WeightBlocks | None = None
    # The checkpoint declares an FP8 KV cache (a ModelOpt export's kv_cache_quant_algo or
    # kv_cache_scheme); the cache still follows --kv-cache-dtype.
    declares_fp8_kv: bool = False

    def validate(self, source: str) -> None:
        """Raise ParamError naming `source` and the field when the shape cannot work."""
        if self.architecture not in ARCHITECTURES:
            raise ParamError(
                "model",
                f"{source}: unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(ARCHITECTURES)}",
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParamError(
                    "model", f"{source}: {name} must be a positive integer, got {value!r}"
                )
        if self.num_heads % self.num_kv_heads != 0:
            raise ParamError(
                "model",
                f"{source}: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})",
            )
        if self.head_dim % 2 != 0:
            raise ParamError("model", f"{source}: head_dim must be even, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + h + lm_head
