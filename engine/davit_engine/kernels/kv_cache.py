"""Writing a step's new keys and values into the paged KV cache (`reshape_and_cache`).

Layout of one layer's cache: `[2, num_blocks, block_size, num_kv_heads, head_dim]`, keys at
index 0 and values at index 1. Token `t` goes to flat slot `slot_mapping[t]` (= block id *
block_size + offset); a negative slot marks a padding token (CUDA-graph padding) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(  # type: ignore[no-untyped-def]
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    value_offset,  # elements between cache[0] and cache[1]
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (dims < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        dst = cache_ptr + slot * num_heads * HEAD_DIM + heads * HEAD_DIM + dims
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + value_offset, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    v: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], contiguous
    slot_mapping: torch.Tensor,  # [T] int64, negative = skip
) -> None:
    """Store each token's key and value at its slot, one program per token."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.is_contiguous()
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache[0].numel(),
        num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain-torch twin of `write_kv`, padding slots included."""
    num_blocks, block_size, num_heads, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, num_heads, head_dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat[0][slots] = k[keep].to(kv_cache.dtype)
    flat[1][slots] = v[keep].to(kv_cache.dtype)
