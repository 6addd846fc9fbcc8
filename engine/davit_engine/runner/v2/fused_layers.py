"""Route the model's elementwise layers to the fused Triton kernels (kernels/layer_ops.py).

Runner V2 owns its model instance, so it swaps the forward of each RMSNorm, attention block and
MLP for one that runs fused kernels, the way a custom-op registry picks a backend
implementation. Weights and the module tree stay as they are; the swap is per instance. An
attention forward whose signature this module does not know is left alone (and counted out),
so a change to the model composition degrades speed, never correctness.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from davit_engine.kernels.layer_ops import qk_norm_rope, rms_norm, silu_mul
from davit_engine.layers.attention import AttentionMetadata
from davit_engine.layers.norm import RMSNorm
from davit_engine.models.llama import LlamaAttention, LlamaMLP

logger = logging.getLogger(__name__)


def _fused_rms_norm(module: RMSNorm) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (2, 3) or x.stride(-1) != 1:
            return RMSNorm.forward(module, x)
        return rms_norm(x, module.weight, module.eps)

    return forward


def _fused_mlp(module: LlamaMLP) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(silu_mul(module.gate_up_proj(x)))

    return forward


def _attention_core(
    module: LlamaAttention,
    x: torch.Tensor,  # [T, hidden]
    cos: torch.Tensor,  # [T, D] or [T, 1, D]
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    num_tokens = x.shape[0]
    heads, kv_heads, dim = module.num_heads, module.num_kv_heads, module.head_dim
    q, k, v = module.qkv_proj(x).split(module.split_sizes, dim=-1)
    q = q.view(num_tokens, heads, dim)  # [T, Hq, D]
    k = k.view(num_tokens, kv_heads, dim)  # [T, Hkv, D]
    v = v.view(num_tokens, kv_heads, dim)
    q_norm, k_norm = module.q_norm, module.k_norm
    eps = q_norm.eps if q_norm is not None else 1e-6
    q, k = qk_norm_rope(
        q,
        k,
        cos,
        sin,
        q_norm.weight if q_norm is not None else None,
        k_norm.weight if k_norm is not None else None,
        eps,
    )
    meta.backend.write_kv(k, v, kv_cache, meta.slot_mapping)
    out = meta.backend.forward(q, kv_cache, meta, module.scale)  # [T, Hq, D]
    return module.o_proj(out.reshape(num_tokens, heads * dim))


def _fused_attention(module: LlamaAttention) -> Any | None:
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    if params[:1] == ["rope"]:  # cos/sin looked up once per step by the model

        def forward_rope(
            rope: tuple[torch.Tensor, torch.Tensor],
            x: torch.Tensor,
            kv_cache: torch.Tensor,
            meta: AttentionMetadata,
        ) -> torch.Tensor:
            return _attention_core(module, x, rope[0], rope[1], kv_cache, meta)

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
            return _attention_core(module, x, cos, sin, kv_cache, meta)

        return forward_positions
    return None


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
        else:
            continue
        if forward is None:
            skipped += 1
            continue
        setattr(module, "forward", forward)  # noqa: B010 - an instance attribute, seen by __call__
        swapped += 1
    if skipped:
        logger.warning(
            "fused layers: %d attention blocks of unknown signature left as they are", skipped
        )
    return swapped
