"""FP8 (e4m3) as the engine stores it: the format's facts and the plain-torch quantization.

Weights and KV caches in FP8 are `torch.float8_e4m3fn` (4 exponent bits, 3 mantissa bits, no
infinities, largest finite value 448). A stored value is `x / scale` rounded to the nearest
e4m3 value (ties to even) and saturated to +-448; reading multiplies by the same scale. The
kernels produce the same bits (`kernels/fp8.py`); this module is their reference and the CPU
path.

Keys of an FP8 KV cache are stored rotated: `k @ H`, with `H` the D x D Sylvester-Hadamard
matrix of +-1 entries (`H @ H^T = D * I`). Queries are rotated the same way when they are read
against them and the scores divided by D, so `q.k` is unchanged, but an outlier channel (a few
of the D dimensions carrying most of a key's magnitude, common in LLM keys) is spread over all
D dimensions before the 3-bit mantissa rounds it: the rounding errors of the dot product then
average out instead of following the largest term. FlashAttention-3 uses the same "incoherent
processing" for its FP8 attention. Measured on SmolLM2-135M: perplexity +1.4% with keys
quantized unrotated, +0.5% rotated (docs/fp8.md). Values need no rotation (their quantization
alone moved perplexity by under 0.01%). Head dims that are not a power of two (16 to 256) are
stored unrotated.
"""

from __future__ import annotations

import functools

import torch

from davit_engine.types import ParamError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest scale a dynamic quantization uses: an all-zero row must not divide by zero.
MIN_SCALE = 1e-12


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """FP8 values of `x / scale` (broadcasting), saturated; computed in float32."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def check_scale_values(scale: torch.Tensor, label: str, source: str) -> None:
    """A checkpoint's FP8 scales (float values) must be finite and non-negative (a zero scale
    is an all-zero channel or block): else ParamError naming `source` and `label` (e.g.
    "weight scale 'model.layers.0.mlp.down_proj.weight_scale'")."""
    values = scale.float()
    bad = ~torch.isfinite(values) | (values < 0)
    if bool(bad.any()):
        first = float(values.flatten()[bad.flatten()][0])
        raise ParamError(
            "model",
            f"{source}: {label} holds {int(bad.sum())} negative or non-finite values "
            f"(e.g. {first}); scales must be finite and non-negative",
        )


def fp8_values_by_key(kv_cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache's values as stored: `[num_blocks, num_kv_heads, head_dim, block_size]`, a
    view of `kv_cache[1]` (whose shape, `[num_blocks, block_size, num_kv_heads, head_dim]`, is
    the bf16 cache's; the bytes of each block are ordered key-minor, see kernels/kv_cache.py)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    return kv_cache[1].view(num_blocks, num_kv_heads, head_dim, block_size)


def write_fp8_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] float8_e4m3fn
    slot_mapping: torch.Tensor,  # [T] int64, negative = skip
    kv_scale: torch.Tensor,  # [2, Hkv] float32
) -> None:
    """Store each token's key and value at its slot of an FP8 cache, in plain torch: keys
    rotated where the head dim allows it and quantized with row 0 of `kv_scale`, values
    quantized with row 1 and stored key-minor in their block (`fp8_values_by_key`). Copied as
    bytes: torch has no FP8 index copy on every device."""
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    keys = k[keep].float()
    if rotates_keys(head_dim):
        keys = keys @ hadamard(head_dim, keys.device)
    flat_keys = kv_cache[0].view(torch.uint8).view(-1, num_kv_heads, head_dim)
    flat_keys[slots] = quantize_fp8(keys, kv_scale[0][:, None]).view(torch.uint8)
    values = fp8_values_by_key(kv_cache).view(torch.uint8)  # [blocks, Hkv, D, block_size]
    values[slots // block_size, :, :, slots % block_size] = quantize_fp8(
        v[keep], kv_scale[1][:, None]
    ).view(torch.uint8)


def rotates_keys(head_dim: int) -> bool:
    """Whether an FP8 KV cache stores keys of this head dim Hadamard-rotated (see above)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


@functools.cache
def _hadamard_cpu(dim: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(dim: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The D x D Sylvester-Hadamard matrix of +-1 entries: `H[i, j] = (-1)^popcount(i & j)`."""
    assert rotates_keys(dim), dim
    return _hadamard_cpu(dim).to(device=device, dtype=dtype)
