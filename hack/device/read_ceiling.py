"""How fast this GPU reads weights from memory at W2's product sizes: a plain read kernel (each
program sums a contiguous run of int32 words, 16 bytes a thread a load, UNROLL loads in flight)
and the library's device-to-device copy, inside CUDA graphs with 6 buffers cycled beyond L2.
Prints one JSON line per size. Exploratory (bench notes, run 27): the ceiling the one-row FP8
products (fp8_gemv) are measured against.

    . hack/device/env.sh && python3 hack/device/read_ceiling.py
"""

from __future__ import annotations

import itertools
import json

import torch
import triton
import triton.language as tl

from davit_tools.bench.timing import graph_us


@triton.jit
def _read_kernel(src, out, words, per_program, BLOCK: tl.constexpr, UNROLL: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0)
    begin = pid.to(tl.int64) * per_program
    end = tl.minimum(begin + per_program, words)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(begin, end, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            idx = start + u * BLOCK + offs
            acc ^= tl.load(src + idx, mask=idx < end, other=0)
    tl.store(out + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):  # type: ignore[no-untyped-def]
    return a ^ b


def _row(mb: int, dev: torch.device, out: torch.Tensor, sms: int) -> dict[str, object]:
    words = mb * 2**20 // 4
    bufs = [torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device=dev) for _ in range(6)]
    cycle = itertools.cycle(bufs)
    row: dict[str, object] = {"mb": mb, "gpu": torch.cuda.get_device_name(dev)}
    for per_sm, unroll, warps in ((8, 1, 4), (8, 2, 4), (8, 4, 4), (4, 4, 8), (16, 2, 4)):
        programs = per_sm * sms
        block = 4 * 32 * warps  # 4 words (16 bytes) a thread
        per_program = triton.cdiv(triton.cdiv(words, programs), block) * block

        def read(programs: int = programs, block: int = block, per_program: int = per_program,
                 unroll: int = unroll, warps: int = warps) -> None:  # fmt: skip
            _read_kernel[(programs,)](next(cycle), out, words, per_program, BLOCK=block,
                                      UNROLL=unroll, num_warps=warps)  # fmt: skip

        us = graph_us(read, 20)
        row[f"read_{per_sm}x{warps}w_u{unroll}_tb_s"] = round(mb * 2**20 / us / 1e6, 3)
    dst = torch.empty_like(bufs[0])
    us = graph_us(lambda: dst.copy_(next(cycle)), 20)
    row["copy_read_plus_write_tb_s"] = round(2 * mb * 2**20 / us / 1e6, 3)
    return row


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = torch.empty(64 * sms, dtype=torch.int32, device=dev)
    for mb in (16, 24, 56, 112):
        print(json.dumps(_row(mb, dev, out, sms)), flush=True)


if __name__ == "__main__":
    main()
