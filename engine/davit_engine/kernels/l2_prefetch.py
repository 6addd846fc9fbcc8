"""Weights prefetched into the GPU's L2 cache while a one-token decode layer's attention runs.

At one token a decoder layer alternates between phases that stream weights (the q/k/v, o,
gate/up and down products, each at most of the memory bandwidth) and phases that read almost
nothing from memory: the rotary kernel with the cache write, attention over a few MB of keys
and values, the split merge and the norms, a chain of short dependent loads. During those
phases memory idles. `l2_prefetch` fills that time: launched after the rotary kernel, its
programs ask the L2 for byte ranges of weights the next products read (the o projection, then
the first rows of gate/up), so those products find part of W in L2 instead of memory. A
prefetch is a hint: it changes no number, only where bytes come from, and the L2 may drop
lines before they are read.

The programs issue their prefetches before the wait for the kernel before (weights are no
output of any kernel of the step; kernels/pdl.py), then wait and let the next kernel launch,
like every kernel of the chain. Its forms (`mode`):

- "lines": every thread issues `prefetch.global.L2` for lines of 128 bytes (sm_80+);
- "bulk": every thread asks the tensor memory accelerator for one run of bytes
  (`cp.async.bulk.prefetch.L2.global`, sm_90+), a few instructions for the whole range;
- "lines-last": as "lines", the lines marked to be evicted last.

On the CPU and under Triton's interpreter (no inline assembly) nothing is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from davit_engine.kernels import capability, interpreted, multiprocessors
from davit_engine.kernels.pdl import gdc_enter, pdl_launch

MODES = ("lines", "bulk", "lines-last")
# Bytes one `prefetch.global.L2` asks for (an L2 line), and the run one thread of the bulk form
# asks for at most (16-byte multiples: the bulk copy's alignment).
_LINE = 128
_ALIGN = 16
# Ranges one launch takes (each a tensor's byte range).
MAX_RANGES = 4
_NUM_WARPS = 4
_BLOCK = 32 * _NUM_WARPS


@triton.jit
def _issue(ptrs, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """`ASM [ptr];` for every element of `ptrs`; kept by the compiler (it has effects)."""
    tl.inline_asm_elementwise(
        ASM + " [$1]; mov.b32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _issue_bulk(ptrs, sizes):  # type: ignore[no-untyped-def]
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0;", "=r,l,r", [ptrs, sizes],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_range(  # type: ignore[no-untyped-def]
    base, nbytes, pid, nprog, MODE: tl.constexpr, LINE: tl.constexpr, BLOCK: tl.constexpr
):
    """This program's share of `nbytes` bytes from `base` (a uint8 pointer, 16-byte aligned,
    `nbytes` a multiple of 16)."""
    if MODE == 1:  # bulk: the range in nprog * BLOCK runs of 16-byte multiples
        units = nbytes // 16
        per = tl.cdiv(units, nprog * BLOCK)
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        first = idx.to(tl.int64) * per
        count = tl.minimum(tl.maximum(units - first, 0), per)
        # a thread with nothing left re-asks for the range's last 16 bytes (no mask in asm)
        start = tl.where(count > 0, first, units - 1)
        size = tl.where(count > 0, count, 1).to(tl.int32) * 16
        _issue_bulk(base + start * 16, size)
    else:
        lines = tl.cdiv(nbytes, LINE)
        per = tl.cdiv(lines, nprog)
        begin = pid * per
        end = tl.minimum(begin + per, lines)
        for i in range(begin, end, BLOCK):
            idx = tl.minimum(i + tl.arange(0, BLOCK), end - 1)
            ptrs = base + idx.to(tl.int64) * LINE
            if MODE == 2:
                _issue(ptrs, "prefetch.global.L2::evict_last")
            else:
                _issue(ptrs, "prefetch.global.L2")


@triton.jit
def _l2_prefetch_kernel(  # type: ignore[no-untyped-def]
    p0, n0, p1, n1, p2, n2, p3, n3,
    NUM: tl.constexpr, MODE: tl.constexpr, LINE: tl.constexpr, BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # before the wait: weights are written by no kernel of the step (pdl.py)
    _prefetch_range(p0, n0, pid, nprog, MODE, LINE, BLOCK)
    if NUM > 1:
        _prefetch_range(p1, n1, pid, nprog, MODE, LINE, BLOCK)
    if NUM > 2:
        _prefetch_range(p2, n2, pid, nprog, MODE, LINE, BLOCK)
    if NUM > 3:
        _prefetch_range(p3, n3, pid, nprog, MODE, LINE, BLOCK)
    gdc_enter(USE_GDC)  # every program waits (pdl.py), though it wrote nothing


def supported(device: torch.device, mode: str = "lines") -> bool:
    """Whether `l2_prefetch` launches on `device` in `mode` (a CUDA GPU, not interpreted; the
    bulk form sm_90+, the lines sm_80+)."""
    if mode not in MODES:
        raise ValueError(f"mode: one of {MODES}, got {mode!r}")
    if device.type != "cuda" or interpreted():
        return False
    return capability(device) >= ((9, 0) if mode == "bulk" else (8, 0))


def byte_range(tensor: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of contiguous `tensor` from byte `offset`, as a uint8 view (both rounded
    down to 16-byte multiples, clipped to the tensor)."""
    if not tensor.is_contiguous():
        raise ValueError("tensor: a prefetched range must come from a contiguous tensor")
    flat = tensor.reshape(-1).view(torch.uint8)
    offset = max(0, min(offset, flat.numel())) // _ALIGN * _ALIGN
    nbytes = max(0, min(nbytes, flat.numel() - offset)) // _ALIGN * _ALIGN
    return flat[offset : offset + nbytes]


def l2_prefetch(ranges: Sequence[torch.Tensor], mode: str = "lines", programs: int = 0) -> Any:
    """Ask the L2 for the bytes of `ranges` (uint8 tensors on one GPU, from `byte_range`), in
    one launch of `programs` programs (0: one per multiprocessor). Returns the launched
    kernel (compiled), or None where nothing launched: off a GPU, under the interpreter, on a
    GPU too old for `mode`, or with nothing to fetch."""
    if mode not in MODES:
        raise ValueError(f"mode: one of {MODES}, got {mode!r}")
    if programs < 0:
        raise ValueError(f"programs: 0 (one per multiprocessor) or more, got {programs}")
    ranges = [r for r in ranges if r.numel() > 0]
    if len(ranges) > MAX_RANGES:
        raise ValueError(
            f"ranges: at most {MAX_RANGES} non-empty ranges a launch, got {len(ranges)}"
        )
    for r in ranges:
        if r.dtype != torch.uint8 or r.dim() != 1 or r.data_ptr() % _ALIGN or r.numel() % _ALIGN:
            raise ValueError("ranges: 1-D uint8 views on 16-byte boundaries (see byte_range)")
        if r.device != ranges[0].device:
            raise ValueError("ranges: all on one device")
    if not ranges or not supported(ranges[0].device, mode):
        return None
    device = ranges[0].device
    args: list[object] = []
    for r in ranges:
        args += [r, r.numel()]
    while len(args) < 2 * MAX_RANGES:
        args += [ranges[0], 0]
    grid = (programs or multiprocessors(device),)
    return _l2_prefetch_kernel[grid](
        *args, NUM=len(ranges), MODE=MODES.index(mode), LINE=_LINE, BLOCK=_BLOCK,
        num_warps=_NUM_WARPS, **pdl_launch(device),
    )  # fmt: skip
