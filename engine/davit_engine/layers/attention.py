"""Paged attention: the per-step metadata, the backend protocol, and the plain-torch reference.

The KV cache of one layer is a tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(keys at index 0, values at index 1) in the model dtype, or in FP8 (`float8_e4m3fn`) with the
layer's per-head scales `kv_scale [2, num_kv_heads]` (float32; row 0 keys, row 1 values): a
stored value times its scale is the key or value. A request's tokens live in the blocks
listed by its row of `block_tables`; token `p` of a request is in block `block_tables[b, p //
block_size]` at offset `p % block_size`. The backend travels inside the metadata, so there is no
module-global forward context and several backends can coexist (the reference is used to check
the Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from davit_engine.layers.fp8 import (
    fp8_values_by_key,
    hadamard,
    is_fp8,
    rotates_keys,
    write_fp8_kv,
)


class AttentionBackend(Protocol):
    """How a layer stores new keys/values and attends over the paged cache.

    Contract of `forward`: each new token of request `b` at absolute position `p` attends to the
    cached tokens of `b` at positions `<= p` (the request's own new tokens included, causally).
    `write_kv` has already run for this step's tokens when `forward` is called. `kv_scale` is
    the layer's `[2, Hkv]` float32 scale table; it must be given for an FP8 cache and is
    ignored otherwise.
    """

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
        kv_scale: torch.Tensor | None = None,  # [2, Hkv] float32
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,  # [2, Hkv] float32
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


@dataclass
class AttentionMetadata:
    """Per-step inputs of every attention layer. Tensors live on the model's device.

    - `slot_mapping [T] int64`: `block_id * block_size + offset` of each new token.
    - `query_start_loc [B+1] int32`: new tokens of request b are `T[qsl[b]:qsl[b+1]]`.
    - `seq_lens [B] int32`: tokens in the cache after this step, the new ones included.
    - `block_tables [B, max_blocks] int32`: each request's blocks, padded with any valid id.
    - `max_query_len`, `max_seq_len`: host-side maxima, so no backend needs a device sync.
    - `scratch`: per-step state a backend computes once and reuses across layers.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    backend: AttentionBackend
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass
class _Group:
    """Requests padded together to `Lq` queries and `Lk = max_blocks * block_size` keys."""

    num_queries: int  # Lq
    token_index: torch.Tensor | None  # [B, Lq] int64 into the step's tokens; None: identity
    src_index: torch.Tensor | None  # [N] int64: real queries within the padded [B * Lq]
    dst_index: torch.Tensor | None  # [N] int64: their token index; None: no padding
    block_index: torch.Tensor  # [B * max_blocks] int64 block ids, request-major
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool, True where the query may attend


class TorchPagedAttention:
    """Reference backend in plain torch, for CPU serving and for testing the Triton kernels.

    Requests are split into decode rows (one new token) and prefill rows (several), each group
    padded only to its own longest query, so a long prefill chunk does not pad every decode row.
    The gather indices and masks are built once per step (in `meta.scratch`), not per layer.
    An FP8 cache is quantized on write and widened to the query dtype on read, with the scales
    applied in that dtype (fp32 on the CPU): FP8 storage, full-precision compute.
    """

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        if is_fp8(kv_cache.dtype):
            assert kv_scale is not None, "an FP8 KV cache needs the layer's kv_scale"
            write_fp8_kv(k, v, kv_cache, slot_mapping, kv_scale)
            return
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        groups: list[_Group] | None = meta.scratch.get("torch_paged_groups")
        if groups is None:
            groups = _plan_groups(meta, int(kv_cache.shape[2]))
            meta.scratch["torch_paged_groups"] = groups
        num_tokens, num_heads, head_dim = q.shape
        if is_fp8(kv_cache.dtype) and rotates_keys(head_dim):
            # Keys are stored as k @ H: q @ H against them, and H H^T = D I.
            q = (q.float() @ hadamard(head_dim, q.device)).to(q.dtype)
            scale = scale / head_dim
        out: torch.Tensor | None = None
        for group in groups:
            num_reqs = group.mask.shape[0]
            # Whole blocks are gathered (one contiguous copy each), not single slots.
            # kg, vg: [B, Hkv, Lk, D]
            kg, vg = _gather_blocks(kv_cache, group.block_index, num_reqs, q.dtype)
            if is_fp8(kv_cache.dtype):
                assert kv_scale is not None, "an FP8 KV cache needs the layer's kv_scale"
                kg = kg * kv_scale[0].to(q.dtype)[None, :, None, None]
                vg = vg * kv_scale[1].to(q.dtype)[None, :, None, None]
            # qg: [B, Lq, Hq, D]; a decode-only step has one query per request, in order.
            qg = q.unsqueeze(1) if group.token_index is None else q[group.token_index]
            og = F.scaled_dot_product_attention(
                qg.transpose(1, 2),
                kg,
                vg,
                attn_mask=group.mask,
                scale=scale,
                enable_gqa=num_heads != kg.shape[1],
            ).transpose(1, 2)  # [B, Lq, Hq, D]
            flat_out = og.reshape(num_reqs * group.num_queries, num_heads, head_dim)
            if len(groups) == 1 and group.dst_index is None:
                return flat_out  # queries already in token order, no padding
            if out is None:
                out = torch.empty_like(q)
            if group.dst_index is None:
                assert group.token_index is not None
                out.index_copy_(0, group.token_index.flatten(), flat_out)
            else:
                assert group.src_index is not None
                out.index_copy_(0, group.dst_index, flat_out.index_select(0, group.src_index))
        assert out is not None
        return out


def _gather_blocks(
    kv_cache: torch.Tensor, block_index: torch.Tensor, num_reqs: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # kv_cache: [2, num_blocks, bs, Hkv, D] -> keys, values: [B, Hkv, max_blocks * bs, D]
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    if is_fp8(kv_cache.dtype):  # gathered as bytes, like the write
        blocks = kv_cache.view(torch.uint8).index_select(1, block_index)
        keys = blocks[0].view(kv_cache.dtype).to(dtype)  # [B * max_blocks, bs, Hkv, D]
        # values are stored [blocks, Hkv, D, bs] (kernels/kv_cache.py)
        values = fp8_values_by_key(blocks).view(kv_cache.dtype).to(dtype).permute(0, 3, 1, 2)
    else:
        blocks = kv_cache.index_select(1, block_index).to(dtype)  # [2, B * mb, bs, Hkv, D]
        keys, values = blocks[0], blocks[1]
    keys = keys.reshape(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = values.reshape(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    return keys, values


def _plan_groups(meta: AttentionMetadata, block_size: int) -> list[_Group]:
    device = meta.seq_lens.device
    qsl = meta.query_start_loc.to("cpu", torch.int64)
    seq_lens = meta.seq_lens.to("cpu", torch.int64)
    query_lens = qsl[1:] - qsl[:-1]
    decode_only = bool((query_lens == 1).all())
    groups = []
    for rows in (
        torch.nonzero(query_lens == 1).flatten(),
        torch.nonzero(query_lens > 1).flatten(),
    ):
        if rows.numel() == 0:
            continue
        q_lens = query_lens[rows]  # [B]
        s_lens = seq_lens[rows]
        max_q = int(q_lens.max())
        max_blocks = (int(s_lens.max()) + block_size - 1) // block_size
        steps = torch.arange(max_q)
        valid = steps[None, :] < q_lens[:, None]  # [B, Lq]
        token_index = torch.where(valid, qsl[rows][:, None] + steps[None, :], 0)
        # Absolute position of each query; padding queries get the last real position so their
        # rows keep at least one visible key (no NaN from an all-masked softmax).
        q_pos = (s_lens - q_lens)[:, None] + torch.minimum(steps[None, :], (q_lens - 1)[:, None])
        tables = meta.block_tables[rows.to(device), :max_blocks].to("cpu", torch.int64)
        key_pos = torch.arange(max_blocks * block_size)
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
            key_pos[None, None, :] < s_lens[:, None, None]
        )
        padded = not bool(valid.all())
        flat_valid = valid.flatten()
        groups.append(
            _Group(
                num_queries=max_q,
                token_index=None if decode_only else token_index.to(device),
                src_index=torch.nonzero(flat_valid).flatten().to(device) if padded else None,
                dst_index=token_index.flatten()[flat_valid].to(device) if padded else None,
                block_index=tables.flatten().to(device),
                mask=mask.unsqueeze(1).to(device),
            )
        )
    return groups
