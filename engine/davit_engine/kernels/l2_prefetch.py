"""Warm the GPU's L2 cache with a weight the next kernels will read.

At decode batch sizes a decoder layer alternates between matmuls that stream weights from HBM
and short latency-bound kernels (norms, rotary, attention over a short KV, the split merge)
during which HBM sits idle. `l2_prefetch(t, max_bytes)` issues bulk L2 prefetches
(`cp.async.bulk.prefetch.L2`, sm_90 and newer) for the first `max_bytes` of `t` and returns at
once: the copy engine fills L2 while the short kernels run, and the matmul that follows reads
that part of its weight from L2 instead of HBM.

The prefetch is a hint: it changes no value, the hardware may drop it, and where it cannot run
(CPU, an older GPU, Triton's interpreter, a non-contiguous tensor) it does nothing.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Bytes per bulk prefetch instruction and instructions per program: 64 programs cover 32 MiB.
CHUNK_BYTES = 16 << 10
CHUNKS_PER_PROGRAM = 32


@triton.jit
def _l2_prefetch_kernel(  # type: ignore[no-untyped-def]
    base,  # uint8 pointer, 16-byte aligned
    nbytes,  # multiple of 16
    CHUNK: tl.constexpr,
    PER_PROGRAM: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = (pid * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(nbytes - offsets, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [base + offsets, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    major, _ = torch.cuda.get_device_capability(device_index)
    return major >= 9


def prefetch_supported(device: torch.device) -> bool:
    """Whether `l2_prefetch` does anything for tensors on `device`."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def l2_prefetch(
    t: torch.Tensor,
    max_bytes: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    chunks_per_program: int = CHUNKS_PER_PROGRAM,
) -> int:
    """Ask for the first `max_bytes` of `t` (all of it if None) in L2; returns the bytes asked for
    (0 where the prefetch cannot run). Never waits for the data."""
    if not t.is_contiguous() or not prefetch_supported(t.device):
        return 0
    total = t.numel() * t.element_size()
    nbytes = total if max_bytes is None else min(total, max_bytes)
    nbytes -= nbytes % 16
    if nbytes <= 0 or t.data_ptr() % 16:
        return 0
    if chunk_bytes % 16 or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
    per_program = chunk_bytes * chunks_per_program
    grid = (triton.cdiv(nbytes, per_program),)
    flat = t.view(-1).view(torch.uint8)
    _l2_prefetch_kernel[grid](
        flat, nbytes, CHUNK=chunk_bytes, PER_PROGRAM=chunks_per_program, num_warps=1
    )
    return nbytes
