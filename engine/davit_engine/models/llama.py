"""The Llama family as one composition: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k norm).

Single-device and unquantized on purpose: projections are fused (q/k/v into `qkv_proj`, gate/up
into `gate_up_proj`) so a layer runs three large matmuls; checkpoints keep the split names, and
`STACKED_PARAMS` declares how they map onto the fused ones. Quantization is applied from outside
(`davit_engine.quant` swaps the projections); `load_weights` fills whatever parameters the
projections then have, FP8 checkpoints' per-tensor or per-channel `weight_scale` included.

Each attention layer owns `kv_scale [2, num_kv_heads]` (float32, keys then values): the scales
of an FP8 KV cache, set by the loader (quant/kv_scales.py) and ignored by a cache in the model
dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from davit_engine.layers.attention import AttentionMetadata
from davit_engine.layers.fp8 import check_scale_values
from davit_engine.layers.norm import RMSNorm
from davit_engine.layers.rotary import RotaryEmbedding
from davit_engine.models.config import ModelConfig
from davit_engine.types import ParamError

# (fused parameter, checkpoint projection name, shard index within the fused output rows)
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# Checkpoint tensors that carry no weights we use: precomputed rotary tables; FP8 checkpoints'
# static activation scales (activations are quantized per token, dynamically) and KV-cache
# scales (an FP8 cache here stores rotated keys, so its scales are calibrated at load:
# quant/kv_scales.py).
IGNORED_SUFFIXES: tuple[str, ...] = (
    "rotary_emb.inv_freq",
    ".input_scale",
    ".k_scale",
    ".v_scale",
    ".kv_scale",
    ".output_scale",
)
# Scale tensors that may hold one value for a whole (split) projection.
SCALE_SUFFIX = ".weight_scale"
# transformers' fine-grained FP8 names its scale so; one value of it (no `weight_block_size`:
# one block the size of the weight) is a per-tensor `weight_scale` (block-wise ones are
# converted before they get here, quant/block_fp8.py).
INVERSE_SCALE_SUFFIX = ".weight_scale_inv"


class LlamaAttention(nn.Module):
    kv_scale: torch.Tensor  # [2, num_kv_heads] float32, a buffer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.split_sizes = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = nn.Linear(
            config.hidden_size, sum(self.split_sizes), bias=config.attention_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # Not in the state dict: no checkpoint of the unquantized model has it.
        self.register_buffer(
            "kv_scale", torch.ones(2, config.num_kv_heads, dtype=torch.float32), persistent=False
        )

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = RotaryEmbedding.rotate(rope, q, k)
        meta.backend.write_kv(k, v, kv_cache, meta.slot_mapping, self.kv_scale)
        out = meta.backend.forward(q, kv_cache, meta, self.scale, self.kv_scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        residual = hidden
        hidden = residual + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        residual = hidden
        return residual + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # One cos/sin table for every layer, looked up once per step.
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over a paged KV cache.

    `forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden]` after the
    final norm; `compute_logits(hidden [N, hidden]) -> [N, vocab] float32`. `kv_caches[i]` is
    layer i's cache `[2, num_blocks, block_size, num_kv_heads, head_dim]` in the model dtype.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"expected {len(self.model.layers)} KV caches (one per layer), got {len(kv_caches)}"
            )
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self.model.rotary.lookup(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, kv_cache, meta)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits: [N, vocab] float32
        return self.lm_head(hidden).float()

    def expected_weight_names(self) -> set[str]:
        """Checkpoint (Hugging Face) names this model needs, fused parameters split back."""
        names = set()
        for name in self.state_dict():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            names.update(_checkpoint_names(name))
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters.

        A `weight_scale` of one value fills its projection's rows of a fused scale (per-tensor
        checkpoints); one value per row is copied as is (per-channel). Raises ParamError naming
        `source` and the tensor on a shape or dtype mismatch, an unknown tensor, or tensors the
        checkpoint lacks.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = self.expected_weight_names()
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name.endswith(INVERSE_SCALE_SUFFIX) and tensor.numel() == 1:
                name = name.removesuffix(INVERSE_SCALE_SUFFIX) + SCALE_SUFFIX
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints also store the head; the embedding wins
            target, rows = self._target(name)
            if target not in params:
                hint = (
                    " (an FP8 checkpoint's scale, but its config declares no FP8 "
                    "quantization_config)"
                    if name.endswith((SCALE_SUFFIX, INVERSE_SCALE_SUFFIX))
                    else ""
                )
                raise ParamError(
                    "model", f"{source}: unexpected tensor {name!r} for this model{hint}"
                )
            param = params[target]
            dest = param.data if rows is None else param.data[rows[0] : rows[1]]
            _copy_checkpoint_tensor(dest, tensor, name, source)
            seen.add(name)
        missing = expected - seen
        if missing:
            listed = ", ".join(sorted(missing)[:5])
            raise ParamError(
                "model", f"{source}: {len(missing)} tensors are missing, e.g. {listed}"
            )

    def _target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """Map a checkpoint name to (parameter name, row range inside a fused parameter)."""
        for fused, part, shard in STACKED_PARAMS:
            marker = f".{part}."
            if marker in name:
                bounds = self._shard_bounds(fused)
                return name.replace(marker, f".{fused}."), (bounds[shard], bounds[shard + 1])
        return name, None

    def _shard_bounds(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            return [0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size]
        return [0, c.intermediate_size, 2 * c.intermediate_size]


def _copy_checkpoint_tensor(
    dest: torch.Tensor, tensor: torch.Tensor, name: str, source: str
) -> None:
    """`dest.copy_(tensor)` with the checks (and the scale broadcast) of `load_weights`."""
    if name.endswith(SCALE_SUFFIX) and tensor.numel() in (1, dest.numel()):
        _check_weight_scale(tensor, name, source)
        tensor = tensor.reshape(()) if tensor.numel() == 1 else tensor.reshape(dest.shape)
        dest.copy_(tensor.float().expand(dest.shape))
        return
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ParamError(
            "model",
            f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model config expects {tuple(dest.shape)}",
        )
    if dest.dtype == torch.float8_e4m3fn and tensor.dtype != dest.dtype:
        # Casting an unscaled tensor into FP8 would silently clip or zero it.
        raise ParamError(
            "model",
            f"{source}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')} but the "
            "checkpoint is quantized (fp8): its projections must be float8_e4m3fn",
        )
    if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point and dest.dtype != tensor.dtype:
        # 8-bit float codes copied as values, without their scale: a wrong model, silently
        raise ParamError(
            "model",
            f"{source}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')} where the "
            f"model holds {str(dest.dtype).removeprefix('torch.')}: FP8 weights load only as "
            "the decoder projections of a checkpoint whose config declares an FP8 "
            "quantization_config (docs/fp8.md)",
        )
    dest.copy_(tensor)
    if dest.dtype == torch.float8_e4m3fn:
        # e4m3fn has no infinities; its NaN codes (0x7F, 0xFF) would make every output of the
        # projection NaN. Checked where the copy landed (on a GPU, one pass at its bandwidth).
        nan_codes = int(((dest.view(torch.uint8) & 0x7F) == 0x7F).sum())
        if nan_codes:
            raise ParamError(
                "model",
                f"{source}: tensor {name!r} holds {nan_codes} NaN codes (e4m3 0x7F / 0xFF); "
                "the checkpoint is damaged",
            )


def _check_weight_scale(tensor: torch.Tensor, name: str, source: str) -> None:
    """A checkpoint's per-tensor or per-channel weight scale: a float tensor of finite,
    non-negative values (a zero scale is an all-zero channel), else ParamError naming it."""
    if not tensor.dtype.is_floating_point or tensor.dtype.itemsize == 1:
        raise ParamError(
            "model",
            f"{source}: weight scale {name!r} is {str(tensor.dtype).removeprefix('torch.')}; "
            "expected a float tensor (float32, bfloat16 or float16)",
        )
    check_scale_values(tensor, f"weight scale {name!r}", source)


def _checkpoint_names(param_name: str) -> list[str]:
    for fused in ("qkv_proj", "gate_up_proj"):
        marker = f".{fused}."
        if marker in param_name:
            return [
                param_name.replace(marker, f".{part}.")
                for f, part, _ in STACKED_PARAMS
                if f == fused
            ]
    return [param_name]
