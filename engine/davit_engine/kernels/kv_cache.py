"""Writing a step's new keys and values into the paged KV cache (`reshape_and_cache`).

Layout of one layer's cache: `[2, num_blocks, block_size, num_kv_heads, head_dim]`, keys at
index 0 and values at index 1. Token `t` goes to flat slot `slot_mapping[t]` (= block id *
block_size + offset); a negative slot marks a padding token (CUDA-graph padding) and is skipped.

An FP8 cache (`float8_e4m3fn`) stores `(k @ H) / k_scale[head]` and `v / v_scale[head]`,
rounded to e4m3 and saturated, with H the Hadamard matrix of the head dim (keys unrotated where
the head dim is not a power of two; `layers/fp8.py` says why keys are rotated); `kv_scale` is
the layer's `[2, num_kv_heads]` float32 table (row 0 keys, row 1 values). A cache in the
model's dtype ignores it. An FP8 cache's values are stored key-minor within each block,
`[num_kv_heads, head_dim, block_size]` (`layers.fp8.fp8_values_by_key`): the attention product
sums over keys, and an 8-bit matrix operand needs its summed dimension contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from davit_engine.kernels.fp8 import hadamard_tile, round_to_e4m3
from davit_engine.layers.fp8 import is_fp8, rotates_keys, write_fp8_kv


@triton.jit
def to_cache_e4m3(x, scale):  # type: ignore[no-untyped-def]
    """`x / scale` in float32, rounded to e4m3 as an FP8 cache stores it (module docstring)."""
    return round_to_e4m3(tl.fdiv(x.to(tl.float32), scale, ieee_rounding=True))


@triton.jit
def key_offsets(slot, heads, dims, num_heads, HEAD_DIM: tl.constexpr):  # type: ignore[no-untyped-def]
    """Element offsets of a token's keys at `slot` (int64) in one layer's cache."""
    return slot * num_heads * HEAD_DIM + heads * HEAD_DIM + dims


@triton.jit
def value_offsets(  # type: ignore[no-untyped-def]
    slot, heads, dims, num_heads, value_offset, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """Element offsets of a token's values at `slot`: beside its keys in the value half of
    the cache, key-minor within the block in an FP8 cache (`[heads, dim, key]`)."""
    if FP8:
        return (
            value_offset
            + (slot // PAGE) * (PAGE * num_heads * HEAD_DIM)
            + heads * (HEAD_DIM * PAGE)
            + dims * PAGE
            + slot % PAGE
        )
    return value_offset + key_offsets(slot, heads, dims, num_heads, HEAD_DIM)


@triton.jit
def store_token_kv(  # type: ignore[no-untyped-def]
    k,  # [BLOCK_H, BLOCK_D] one token's keys, in the model dtype
    v,  # [BLOCK_H, BLOCK_D] its values
    cache_ptr,
    slot,  # int64 flat slot, >= 0
    scale_ptr,
    value_offset,
    num_heads,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    h,  # [BLOCK_D, BLOCK_D] the Hadamard tile in k's dtype where ROTATE (else unused)
):
    """Store one token's keys and values at `slot` in the cache's layout (module docstring):
    shared by `write_kv` and the rotary kernel that writes the cache itself, so both store the
    same bytes."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    k_scale, v_scale = kv_scales(scale_ptr, heads, heads < num_heads, num_heads, FP8)
    store_rows_kv(
        k, v, cache_ptr, slot, heads, heads < num_heads, k_scale, v_scale, value_offset,
        num_heads, PAGE, HEAD_DIM, BLOCK_D, FP8, ROTATE, DOT_PRECISION, h,
    )  # fmt: skip


@triton.jit
def kv_scales(scale_ptr, heads, valid, num_heads, FP8: tl.constexpr):  # type: ignore[no-untyped-def]
    """An FP8 cache's key and value scales of each row's head (`[ROWS, 1]` float32 each, 1.0
    where not `valid`), from the layer's `[2, num_heads]` table; 1.0 for a cache in the model
    dtype."""
    if FP8:
        k_scale = tl.load(scale_ptr + heads, mask=valid, other=1.0)
        v_scale = tl.load(scale_ptr + num_heads + heads, mask=valid, other=1.0)
        return k_scale, v_scale
    else:
        return 1.0, 1.0


@triton.jit
def store_rows_kv(  # type: ignore[no-untyped-def]
    k,  # [ROWS, BLOCK_D] keys in the model dtype, a head a row
    v,  # [ROWS, BLOCK_D] their values
    cache_ptr,
    slot,  # [ROWS, 1] int64: each row's token's flat slot (or a scalar for one token)
    heads,  # [ROWS, 1]: each row's KV head
    valid,  # [ROWS, 1]: the rows to store (a real head of a token with a slot)
    k_scale,  # [ROWS, 1] float32 each: the rows' scales (`kv_scales`; unused unless FP8)
    v_scale,
    value_offset,
    num_heads,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    h,  # [BLOCK_D, BLOCK_D] the Hadamard tile in k's dtype where ROTATE (else unused)
):
    """Store rows of keys and values, each row one KV head of one token, in the cache's
    layout (module docstring): `store_token_kv` for one token, the rotary kernel's token groups
    for several. A row's bytes do not depend on the other rows (the rotation is a product of
    the row with H), so one token stores the same bytes either way."""
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = valid & (dims < HEAD_DIM)
    if FP8:
        if ROTATE:  # k @ H on the matrix units (16 rows or more; exact products)
            k = tl.dot(k, h, input_precision=DOT_PRECISION)
        k = to_cache_e4m3(k, k_scale)
        v = to_cache_e4m3(v, v_scale)
    dst = cache_ptr + key_offsets(slot, heads, dims, num_heads, HEAD_DIM)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    v_dst = cache_ptr + value_offsets(
        slot, heads, dims, num_heads, value_offset, PAGE, HEAD_DIM, FP8
    )
    tl.store(v_dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(  # type: ignore[no-untyped-def]
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    value_offset,  # elements between cache[0] and cache[1]
    num_heads,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (dims < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        h = hadamard_tile(BLOCK_D, k.dtype) if ROTATE else 0
        store_token_kv(
            k, v, cache_ptr, slot, scale_ptr, value_offset, num_heads, PAGE, HEAD_DIM, BLOCK_H,
            BLOCK_D, FP8, ROTATE, DOT_PRECISION, h,
        )  # fmt: skip


def head_tile_rows(num_heads: int, rotate: bool) -> int:
    """Rows of a per-token tile of heads (the key tile `store_token_kv` takes; the query tile
    the rotary kernel rotates): the heads padded to a power of two, and to the 16 rows a
    matrix-unit product needs where the tile is rotated."""
    block_h = triton.next_power_of_2(num_heads)
    return max(block_h, 16) if rotate else block_h


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    v: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], contiguous
    slot_mapping: torch.Tensor,  # [T] int64, negative = skip
    kv_scale: torch.Tensor | None = None,  # [2, Hkv] float32: needed for an FP8 cache
) -> None:
    """Store each token's key and value at its slot, one program per token."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.is_contiguous()
    fp8 = is_fp8(kv_cache.dtype)
    if fp8:
        assert kv_scale is not None and tuple(kv_scale.shape) == (2, num_heads)
        assert kv_scale.dtype == torch.float32 and kv_scale.is_contiguous()
    rotate = fp8 and rotates_keys(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        kv_scale if fp8 else slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache[0].numel(),
        num_heads,
        PAGE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_H=head_tile_rows(num_heads, rotate),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8,
        ROTATE=rotate,
        DOT_PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
    )


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Plain-torch twin of `write_kv`, padding slots included."""
    if is_fp8(kv_cache.dtype):
        assert kv_scale is not None
        write_fp8_kv(k, v, kv_cache, slot_mapping, kv_scale)
        return
    num_blocks, block_size, num_heads, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, num_heads, head_dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat[0][slots] = k[keep].to(kv_cache.dtype)
    flat[1][slots] = v[keep].to(kv_cache.dtype)
