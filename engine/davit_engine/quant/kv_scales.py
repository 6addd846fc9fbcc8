"""The scales of an FP8 KV cache: static, per layer, calibrated once at load.

An FP8 cache stores `(k @ H) / k_scale` and `v / v_scale` (e4m3, saturating at +-448; H the
Hadamard rotation of `layers/fp8.py`), one scale per layer for keys and one for values. Scales
cannot change while serving: every block already written was encoded with them, and prefix
caching reuses blocks across requests. So they are fixed when the model loads, by a calibration
prefill: `CALIBRATION_TOKENS` token ids drawn uniformly from the vocabulary (seeded, BOS first
when the model has one) go through the model, with the projections that will serve, into a
cache in the model dtype; each layer's scale is its largest absolute (rotated) key, and value,
times `HEADROOM`, over 448. FP8 checkpoints' own `k_scale`/`v_scale` are not used: they measure
unrotated keys, and one rule for every checkpoint keeps the numbers comparable.

Why random ids and a headroom of 2: the text a model serves reaches larger keys and values than
the calibration prefill, and a value beyond `scale * 448` saturates; a larger scale costs almost
nothing (e4m3 keeps its 3 mantissa bits over 15 binades below its maximum, so doubling the
scale only moves values below 2^-15 of the maximum into subnormals). On SmolLM2-135M the
largest rotated key and value of every layer over the fixed English text of the quality tests
stayed within 1.7x and 1.9x of the calibration's (tests/engine/quant/test_kv_scales.py).

Per-head scales (one per KV head and layer) are supported by the kernels and the cache layout
(`kv_scale [2, num_kv_heads]`) and chosen by `per_head=True`. The default is per layer: on
SmolLM2-135M per-head scales gave perplexity +0.24% against +0.52% per layer, a difference of
the size that changing the scale alone produces (+0.52% to +0.73% for headroom 2 and 1), so not
a measured gain (docs/fp8.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from davit_engine.layers.attention import AttentionMetadata, TorchPagedAttention
from davit_engine.layers.fp8 import FP8_MAX, MIN_SCALE, hadamard, rotates_keys
from davit_engine.layers.parallel import TensorParallel
from davit_engine.models.config import ModelConfig
from davit_engine.models.llama import LlamaAttention, LlamaForCausalLM

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0
HEADROOM = 2.0
_BLOCK = 16


def calibration_ids(config: ModelConfig, num_tokens: int, seed: int) -> torch.Tensor:
    """The calibration prompt: uniform token ids from a seeded generator, BOS first."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=generator)
    if config.bos_token_id is not None:
        ids[0] = config.bos_token_id
    return ids


def measure_kv_amax(
    model: LlamaForCausalLM, token_ids: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Largest absolute key and value per layer and KV head over one prefill of `token_ids`:
    `[num_layers, 2, num_kv_heads]` float32 (keys as an FP8 cache stores them: after rotary,
    Hadamard-rotated where the head dim allows it)."""
    c = model.config
    num_tokens = int(token_ids.shape[0])
    num_blocks = -(-num_tokens // _BLOCK)
    caches = [
        torch.zeros(2, num_blocks, _BLOCK, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        for _ in range(c.num_layers)
    ]
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        backend=TorchPagedAttention(),
    )
    rotation = hadamard(c.head_dim, device) if rotates_keys(c.head_dim) else None
    amax = []
    with torch.inference_mode():
        model(token_ids.to(device), positions, caches, meta)
        # cache: [2, blocks, block, Hkv, D]; unwritten slots are zeros and change no maximum.
        for cache in caches:
            keys = cache[0].float() if rotation is None else cache[0].float() @ rotation
            amax.append(
                torch.stack(
                    [keys.abs().amax(dim=(0, 1, 3)), cache[1].float().abs().amax(dim=(0, 1, 3))]
                )
            )
    return torch.stack(amax).cpu()


def scales_from_amax(amax: torch.Tensor, per_head: bool, headroom: float) -> torch.Tensor:
    """`[num_layers, 2, Hkv]` maxima -> scales of the same shape (per layer: the maximum over
    the heads, repeated)."""
    if not per_head:
        amax = amax.amax(dim=2, keepdim=True).expand_as(amax)
    return (amax * headroom / FP8_MAX).clamp(min=MIN_SCALE)


def set_kv_scales(model: LlamaForCausalLM, scales: torch.Tensor) -> None:
    """Copy `[num_layers, 2, Hkv]` scales into each attention layer's `kv_scale`."""
    attentions = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    assert len(attentions) == scales.shape[0]
    with torch.no_grad():
        for attention, layer_scales in zip(attentions, scales, strict=True):
            attention.kv_scale.copy_(layer_scales)


def calibrate_kv_scales(
    model: LlamaForCausalLM,
    device: torch.device,
    dtype: torch.dtype,
    per_head: bool = False,
    headroom: float = HEADROOM,
    num_tokens: int = CALIBRATION_TOKENS,
    seed: int = CALIBRATION_SEED,
    tensor_parallel: TensorParallel | None = None,
) -> torch.Tensor:
    """Run the calibration prefill and set every layer's scales; returns them
    (`[num_layers, 2, Hkv]`). With `tensor_parallel` every rank runs it at once (the prefill's
    collectives) over its own KV heads, and a layer's scale is its largest over all ranks'
    heads: the single-device scale."""
    num_tokens = max(1, min(num_tokens, model.config.max_position_embeddings))
    ids = calibration_ids(model.config, num_tokens, seed)
    amax = measure_kv_amax(model, ids, device, dtype)
    if tensor_parallel is not None and not per_head:
        layer_amax = amax.amax(dim=2, keepdim=True).contiguous()
        dist.all_reduce(layer_amax, op=dist.ReduceOp.MAX, group=tensor_parallel.control_group)
        amax = layer_amax.expand_as(amax)
    scales = scales_from_amax(amax, per_head, headroom)
    set_kv_scales(model, scales)
    return scales
