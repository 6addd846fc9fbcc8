"""`TritonPagedAttention`: the attention backend that runs the Triton kernels of this package."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from davit_engine.kernels.kv_cache import write_kv
from davit_engine.kernels.paged_attention import default_num_splits, paged_attention
from davit_engine.layers.fp8 import is_fp8

if TYPE_CHECKING:
    from davit_engine.layers.attention import AttentionMetadata

NUM_KV_SPLITS_KEY = "num_kv_splits"
# Steps whose requests bring at most this many new tokens each (decode, and speculative
# verification's K + 1) split the key range too: their few query rows per request leave most
# of the GPU idle otherwise, one program walking the whole context per request and KV head.
SPLIT_MAX_QUERY_LEN = 16


class TritonPagedAttention:
    """Implements `layers.attention.AttentionBackend` with the Triton kernels.

    Decode and verification steps (at most `SPLIT_MAX_QUERY_LEN` new tokens per request) split
    the key range when the batch is too small to fill the GPU. The split
    count comes from `meta.scratch["num_kv_splits"]` when the runner fixes it (a CUDA graph must
    see the same launch shape on every replay); otherwise from the batch size and the host-side
    `max_seq_len`.
    """

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
        kv_scale: torch.Tensor | None = None,  # [2, Hkv] float32 (FP8 cache)
    ) -> None:
        write_kv(k, v, kv_cache, slot_mapping, kv_scale)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,  # [2, Hkv] float32 (FP8 cache)
        queries_rotated: bool = False,  # q is q @ H already (see paged_attention)
    ) -> torch.Tensor:  # [T, Hq, D]
        num_splits = 1
        fixed = meta.scratch.get(NUM_KV_SPLITS_KEY)
        if isinstance(fixed, int):
            num_splits = fixed
        elif meta.max_query_len <= SPLIT_MAX_QUERY_LEN:
            num_splits = default_num_splits(
                int(meta.seq_lens.shape[0]),
                int(kv_cache.shape[3]),
                meta.max_seq_len,
                q.device,
                fp8=is_fp8(kv_cache.dtype),
            )
        return paged_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            num_splits,
            kv_scale=kv_scale,
            queries_rotated=queries_rotated,
        )
