"""Route the model's layers to the fused Triton kernels (kernels/layer_ops.py).

Runner V2 owns its model instance, so it swaps the forward of each RMSNorm, attention block,
MLP and of the model itself for one that runs fused kernels, the way a custom-op
registry picks a backend implementation. Weights and the module tree stay as they are; the swap
is per instance. Per decoder layer at decode batch sizes:

- the residual add after attention and after the MLP each run in one kernel with the RMSNorm
  that follows (the next layer's input norm, or the final norm);
- q/k norm + rotary write the rotated keys and the values straight into the paged KV cache
  when the attention backend is the Triton one (no separate cache-write kernel), an FP8 cache
  included (quantized with the layer's `kv_scale`, keys and queries Hadamard-rotated);
- SiLU x up runs in the epilogue of an FP8 gate/up projection's matrix-vector kernel (decode
  at one or two rows), else as its own kernel after the projection.

An attention forward whose signature this module does not know is left alone (and counted
out), so a change to the model composition degrades speed, never correctness.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, cast

import torch
from torch import nn

from davit_engine.kernels import fp8_mlp_block, interpreted
from davit_engine.kernels.attention_backend import TritonPagedAttention
from davit_engine.kernels.layer_ops import add_rms_norm, qk_norm_rope, rms_norm, silu_mul
from davit_engine.layers.attention import AttentionMetadata
from davit_engine.layers.fp8 import is_fp8, rotates_keys
from davit_engine.layers.norm import RMSNorm
from davit_engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from davit_engine.quant.fp8_linear import Fp8Linear, Fp8Projection

logger = logging.getLogger(__name__)


def _fused_rms_norm(module: RMSNorm) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (2, 3) or x.stride(-1) != 1:
            return RMSNorm.forward(module, x)
        return rms_norm(x, module.weight, module.eps)

    return forward


# Whether an FP8 gate/up projection applies SiLU x up in its own kernel at decode rows
# (`Fp8Linear.forward_silu_mul`); a switch so that a benchmark can time both.
FUSE_FP8_GATE_ACTIVATION = True


def _fused_mlp(module: LlamaMLP) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        gate_up = module.gate_up_proj
        if FUSE_FP8_GATE_ACTIVATION and isinstance(gate_up, Fp8Projection):
            return module.down_proj(gate_up.forward_silu_mul(x))
        return module.down_proj(silu_mul(gate_up(x)))

    return forward


def _attention_heads(
    module: LlamaAttention,
    x: torch.Tensor,  # [T, hidden]
    cos: torch.Tensor,  # [T, D] or [T, 1, D]
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    qkv: torch.Tensor | None = None,  # [T, q + 2 kv]: the projection, when the caller made it
) -> torch.Tensor:  # [T, Hq * D], the o projection's input
    num_tokens = x.shape[0]
    heads, kv_heads, dim = module.num_heads, module.num_kv_heads, module.head_dim
    if qkv is None:
        qkv = module.qkv_proj(x)
    q, k, v = qkv.split(module.split_sizes, dim=-1)
    q = q.view(num_tokens, heads, dim)  # [T, Hq, D]
    k = k.view(num_tokens, kv_heads, dim)  # [T, Hkv, D]
    v = v.view(num_tokens, kv_heads, dim)
    q_norm, k_norm = module.q_norm, module.k_norm
    eps = q_norm.eps if q_norm is not None else 1e-6
    q_weight = q_norm.weight if q_norm is not None else None
    k_weight = k_norm.weight if k_norm is not None else None
    kv_scale = module.kv_scale
    backend = meta.backend
    fp8 = is_fp8(kv_cache.dtype)
    if isinstance(backend, TritonPagedAttention) and (kv_cache.dtype == x.dtype or fp8):
        # The Triton backend's cache layout (model dtype or FP8): the rotary kernel writes the
        # cache, and rotates the queries where an FP8 cache stores rotated keys, so attention
        # holds no Hadamard tile.
        rotate_q = fp8 and rotates_keys(dim)
        q, _ = qk_norm_rope(
            q, k, cos, sin, q_weight, k_weight, eps, v=v, kv_cache=kv_cache,
            slot_mapping=meta.slot_mapping, kv_scale=kv_scale, rotate_queries=rotate_q,
        )  # fmt: skip
        out = backend.forward(q, kv_cache, meta, module.scale, kv_scale, queries_rotated=rotate_q)
    else:
        q, k_rot = qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps)
        assert k_rot is not None
        backend.write_kv(k_rot, v, kv_cache, meta.slot_mapping, kv_scale)
        out = backend.forward(q, kv_cache, meta, module.scale, kv_scale)  # [T, Hq, D]
    return out.reshape(num_tokens, heads * dim)


def _fused_attention(module: LlamaAttention) -> Any | None:
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    if params[:1] == ["rope"]:  # cos/sin looked up once per step by the model

        def forward_rope(
            rope: tuple[torch.Tensor, torch.Tensor],
            x: torch.Tensor,
            kv_cache: torch.Tensor,
            meta: AttentionMetadata,
        ) -> torch.Tensor:
            return module.o_proj(_attention_heads(module, x, rope[0], rope[1], kv_cache, meta))

        return forward_rope
    rotary = getattr(module, "rotary", None)
    if params[:1] == ["positions"] and rotary is not None:

        def forward_positions(
            positions: torch.Tensor,
            x: torch.Tensor,
            kv_cache: torch.Tensor,
            meta: AttentionMetadata,
        ) -> torch.Tensor:
            cos = rotary.cos_table[positions]
            sin = rotary.sin_table[positions]
            return module.o_proj(_attention_heads(module, x, cos, sin, kv_cache, meta))

        return forward_positions
    return None


def _mlp_block_weights(
    layer: LlamaDecoderLayer, next_norm: RMSNorm, device: torch.device
) -> fp8_mlp_block.MlpBlockWeights | None:
    """The layer's o projection, post-attention norm, MLP and the norm after the layer for
    `fp8_mlp_block`, or None where they cannot run it (a projection not FP8 or biased, tiles
    that are not whole on this device, a projection with a forward hook)."""
    projections = (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    fp8 = [
        m
        for m in projections
        # a hook (tensor parallelism's all-reduce of o and down) would be skipped by the block
        if isinstance(m, Fp8Linear) and m.bias is None and not m._forward_hooks
    ]
    if len(fp8) != len(projections):
        return None
    o, gate_up, down = fp8
    post = layer.post_attention_layernorm
    o_s, gate_up_s, down_s = (cast(torch.Tensor, m.weight_scale) for m in fp8)
    weights = fp8_mlp_block.MlpBlockWeights(
        o.weight, o_s, post.weight, post.eps, gate_up.weight, gate_up_s, down.weight, down_s,
        next_norm.weight, next_norm.eps,
    )  # fmt: skip
    return weights if fp8_mlp_block.check_shapes(weights, device) is None else None


class _MlpBlocks:
    """Per layer, the persistent block's weights and counters (None: the layer runs unfused),
    made at the first one-token step outside a CUDA graph capture (the runner's eager warm-up):
    the counters must outlive every graph that launches the block."""

    def __init__(self) -> None:
        self.blocks: list[tuple[fp8_mlp_block.MlpBlockWeights, torch.Tensor] | None] | None = None

    def get(
        self, layers: list[LlamaDecoderLayer], norms: list[RMSNorm], hidden: torch.Tensor
    ) -> list[tuple[fp8_mlp_block.MlpBlockWeights, torch.Tensor] | None] | None:
        if not PERSISTENT_FP8_MLP or hidden.shape[0] != 1:
            return None
        if self.blocks is None:
            device = hidden.device
            if not fp8_mlp_block.supported(device) or torch.cuda.is_current_stream_capturing():
                return None
            made = [
                _mlp_block_weights(layer, norm, device)
                for layer, norm in zip(layers, norms, strict=True)
            ]
            self.blocks = [
                (w, fp8_mlp_block.new_counters(device)) if w is not None else None for w in made
            ]
        return self.blocks


# Whether a one-token step runs each decoder layer's o projection, post-attention norm, FP8
# MLP and the norm after it as one persistent kernel (kernels/fp8_mlp_block.py) where the
# layer's projections are FP8. Off: on an H100 (bench notes, run 27) W2 ran at 246.2 decode
# tok/s with it against 277.2 without. A switch so that a benchmark can time both.
PERSISTENT_FP8_MLP = False


# Whether a one-token step folds each residual add + RMSNorm between two FP8 products into
# them (`Fp8Projection.forward_add_norm` after attention and the MLP, `forward_normed` for
# q/k/v and gate/up, each scale layout in its own one-row kernel): 63 fewer launches a step at 32 layers (the first layer's input norm
# and the final norm stay kernels of their own). On: on an H100 (bench notes, run 28) W2 with
# FP8 weights and KV ran at 288.5 decode tok/s with it against 281.3 without (medians of
# three), and its GPU tests passed (greedy tokens through runner V2 at float32 equal to the
# unfused kernels'). A switch so that a benchmark can time both.
NORM_IN_ONE_ROW_PRODUCTS = True


def _fp8_projections(layer: LlamaDecoderLayer) -> tuple[Fp8Projection, ...] | None:
    """The layer's q/k/v, o, gate/up and down projections where all four are FP8 projections
    whose one-row kernels fold the norms (either scale layout: `Fp8Projection.folds_norms`),
    without a forward hook (tensor parallelism's all-reduce), and o, gate/up and down without a
    bias."""
    found = (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    )  # fmt: skip
    if not all(
        isinstance(m, Fp8Projection) and m.folds_norms() and not m._forward_hooks for m in found
    ):
        return None
    if any(m.bias is not None for m in found[1:]):
        return None
    return cast(tuple[Fp8Projection, ...], found)


def _norm_chain(
    layers: list[LlamaDecoderLayer], hidden: torch.Tensor
) -> list[tuple[Fp8Projection, ...]] | None:
    """Every layer's FP8 projections (`_fp8_projections`) where this step runs the layers with
    the norms folded into the products (the switch, one token, a GPU or Triton's interpreter,
    every layer's projections FP8); None otherwise."""
    if not NORM_IN_ONE_ROW_PRODUCTS or hidden.shape[0] != 1:
        return None
    if hidden.device.type != "cuda" and not interpreted():
        return None
    found = [_fp8_projections(layer) for layer in layers]
    return None if None in found else cast(list[tuple[Fp8Projection, ...]], found)


def _fused_model(model: LlamaForCausalLM) -> Any:
    """The model's forward with every residual add fused into the RMSNorm after it."""
    layers: list[LlamaDecoderLayer] = [cast(LlamaDecoderLayer, m) for m in model.model.layers]
    norms_after_mlp: list[RMSNorm] = [layer.input_layernorm for layer in layers[1:]]
    norms_after_mlp.append(model.model.norm)
    mlp_blocks = _MlpBlocks()

    def forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(layers):
            raise ValueError(
                f"expected {len(layers)} KV caches (one per layer), got {len(kv_caches)}"
            )
        residual = model.model.embed_tokens(input_ids)  # [T, hidden]
        rope = model.model.rotary.lookup(positions, residual.dtype)
        if residual.shape[0] == 0:
            return model.model.norm(residual)
        first = layers[0].input_layernorm
        x = rms_norm(residual, first.weight, first.eps)
        blocks = mlp_blocks.get(layers, norms_after_mlp, residual)
        chain = _norm_chain(layers, residual) if blocks is None else None
        if chain is not None:
            return _norm_chain_forward(
                layers, chain, norms_after_mlp, x, residual, rope, kv_caches, meta
            )
        for i, (layer, kv_cache, next_norm) in enumerate(
            zip(layers, kv_caches, norms_after_mlp, strict=True)
        ):
            block = blocks[i] if blocks is not None else None
            if block is not None:
                heads = _attention_heads(layer.self_attn, x, rope[0], rope[1], kv_cache, meta)
                x, residual = fp8_mlp_block.fp8_mlp_block(heads, residual, *block)
                continue
            attn = layer.self_attn(rope, x, kv_cache, meta)
            post = layer.post_attention_layernorm
            x, residual = add_rms_norm(attn, residual, post.weight, post.eps)
            x, residual = add_rms_norm(layer.mlp(x), residual, next_norm.weight, next_norm.eps)
        return x

    return forward


def _norm_chain_forward(
    layers: list[LlamaDecoderLayer],
    projections: list[tuple[Fp8Projection, ...]],  # each layer's q/k/v, o, gate/up, down
    norms_after_mlp: list[RMSNorm],
    x: torch.Tensor,  # [1, hidden]: the first layer's input, normed
    residual: torch.Tensor,  # [1, hidden], updated in place
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """One token through the layers with every add + RMSNorm between two products folded into
    them (`NORM_IN_ONE_ROW_PRODUCTS`); the final norm stays a kernel."""
    squares: torch.Tensor | None = None  # None: x is normed (the first layer)
    eps = 0.0
    last = len(layers) - 1
    for i, (layer, (qkv_proj, o_proj, gate_up, down), kv_cache, next_norm) in enumerate(
        zip(layers, projections, kv_caches, norms_after_mlp, strict=True)
    ):
        attn = layer.self_attn
        qkv = None if squares is None else qkv_proj.forward_normed(x, squares, eps)
        heads = _attention_heads(attn, x, rope[0], rope[1], kv_cache, meta, qkv=qkv)
        post = layer.post_attention_layernorm
        xw, post_squares = o_proj.forward_add_norm(heads, residual, post.weight)
        hidden = gate_up.forward_normed(xw, post_squares, post.eps, gated=True)
        if i < last:
            x, squares = down.forward_add_norm(hidden, residual, next_norm.weight)
            eps = next_norm.eps
        else:
            x, residual = add_rms_norm(down(hidden), residual, next_norm.weight, next_norm.eps)
    return x


def _fusable_model(model: nn.Module) -> bool:
    """A LlamaForCausalLM whose decoder layers and attention take the rope tuple (the shape the
    fused model forward calls)."""
    if type(model) is not LlamaForCausalLM:
        return False
    if any(type(layer) is not LlamaDecoderLayer for layer in model.model.layers):
        return False
    params = list(inspect.signature(LlamaAttention.forward).parameters)[1:]
    return params[:1] == ["rope"]


def install_fused_layers(model: nn.Module) -> int:
    """Swap in the fused kernels on every matching submodule; returns how many were swapped."""
    swapped = 0
    skipped = 0
    for module in model.modules():
        forward: Any | None
        if isinstance(module, RMSNorm):
            forward = _fused_rms_norm(module)
        elif isinstance(module, LlamaAttention):
            forward = _fused_attention(module)
        elif isinstance(module, LlamaMLP):
            forward = _fused_mlp(module)
        elif isinstance(module, LlamaForCausalLM):
            forward = _fused_model(module) if _fusable_model(module) else None
        else:
            continue
        if forward is None:
            skipped += 1
            continue
        setattr(module, "forward", forward)  # noqa: B010 - an instance attribute, seen by __call__
        swapped += 1
    if skipped:
        logger.warning("fused layers: %d modules of unknown composition left as they are", skipped)
    return swapped
