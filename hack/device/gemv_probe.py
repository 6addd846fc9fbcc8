"""One-row FP8 products at W2's shapes in three forms: the engine's `fp8_gemv` (default
tile), W stored tiled so that each program's [BLOCK_N, BLOCK_K] step is one contiguous block,
and two K steps' loads issued before either step's multiply-adds (with and without a cap of
64 registers). Inside CUDA graphs, 6 weight copies cycled beyond L2; prints one JSON line per
shape (us and TB/s of FP8 bytes) and writes them to $OUT/gemv_probe.jsonl. Exploratory (bench
notes, run 27).

    . hack/device/env.sh && python3 hack/device/gemv_probe.py
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from davit_engine.kernels.fp8_gemv import default_config, fp8_gemv
from davit_engine.kernels.pdl import gdc_enter, pdl_launch
from davit_tools.bench.timing import graph_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 6


@triton.jit
def _probe_kernel(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, s_ptr, out_ptr, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILED: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """TILED: W stored by `tile`, one step a round; else W row-major, two steps a round."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (rows * 0)[:, None]
    gdc_enter(USE_GDC)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if TILED:
        steps = K // BLOCK_K
        base = w_ptr + pid.to(tl.int64) * steps * (BLOCK_N * BLOCK_K)
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + ks[None, :]
        for s in range(steps):
            w = tl.load(base + s * (BLOCK_N * BLOCK_K) + offs)
            x = tl.load(x_row + (s * BLOCK_K + ks)[None, :])
            acc += w.to(tl.float32) * x.to(tl.float32)
    else:
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        for k0 in range(0, K, 2 * BLOCK_K):
            kk = k0 + ks
            w0 = tl.load(w_rows + kk[None, :])
            w1 = tl.load(w_rows + (kk + BLOCK_K)[None, :])
            x0 = tl.load(x_row + kk[None, :])
            x1 = tl.load(x_row + (kk + BLOCK_K)[None, :])
            acc += w0.to(tl.float32) * x0.to(tl.float32)
            acc += w1.to(tl.float32) * x1.to(tl.float32)
    out = tl.sum(acc, 1) * tl.load(s_ptr + rows)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty))


def tile(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """W [N, K] with each [bn, bk] tile stored contiguously, a program's tiles one after another."""
    n, k = w.shape
    return w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous().view(n, k)


def probe_shape(name: str, n: int, k: int, dev: torch.device) -> dict[str, object]:
    ws = [(torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn) for _ in range(COPIES)]
    ss = [torch.rand(n, device=dev) + 0.5 for _ in range(COPIES)]
    x = torch.randn(1, k, device=dev).to(torch.bfloat16)
    cfg = default_config(1, n, dev)
    bn, bk = cfg.block_n, cfg.block_k
    tiled = [tile(w, bn, bk) for w in ws]
    y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    turn = [0]

    def nxt() -> int:
        turn[0] = (turn[0] + 1) % COPIES
        return turn[0]

    def base() -> torch.Tensor:
        i = nxt()
        return fp8_gemv(x, ws[i], ss[i])

    def tiled_fn() -> torch.Tensor:
        i = nxt()
        _probe_kernel[(n // bn,)](x, tiled[i], ss[i], y, k, BLOCK_N=bn, BLOCK_K=bk, TILED=True,
                                  num_warps=4, **pdl_launch(dev))  # fmt: skip
        return y

    def unroll_fn(regs: int | None) -> Callable[[], torch.Tensor]:
        limits = {"maxnreg": regs} if regs else {}

        def run() -> torch.Tensor:
            i = nxt()
            _probe_kernel[(n // bn,)](x, ws[i], ss[i], y, k, BLOCK_N=bn, BLOCK_K=bk,
                                      TILED=False, num_warps=4, **limits,
                                      **pdl_launch(dev))  # fmt: skip
            return y

        return run

    ref = fp8_gemv(x, ws[0], ss[0])
    turn[0] = COPIES - 1
    tiled_fn()
    torch.cuda.synchronize()
    row: dict[str, object] = {"shape": name, "n": n, "k": k, "tile": f"{bn}x{bk}",
                              "tiled_equal": bool(torch.equal(y, ref))}  # fmt: skip
    forms = (("default", base), ("tiled", tiled_fn), ("unroll2", unroll_fn(None)),
             ("unroll2_r64", unroll_fn(64)))  # fmt: skip
    for label, fn in forms:
        us = graph_us(fn, 20)
        row[f"{label}_us"] = round(us, 2)
        row[f"{label}_tb_s"] = round(n * k / us / 1e6, 3)
    return row


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        rows.append(probe_shape(name, n, k, dev))
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gemv_probe.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
