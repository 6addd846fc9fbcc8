"""Decode-step kernels at batch 1 on W2's model shape (Llama-3.1-8B), each timed inside a CUDA
graph.

`python3 -m davit_tools.bench.w2_kernels` prints one JSON line per measurement (configuration
included): the library GEMM for every linear shape of the model at 1 and 8 rows (weights cycled
beyond the L2 cache, as in a real step); decode attention at 1,152 keys for several split counts; the fused residual
add + RMSNorm against the two separate kernels; rotary with the KV-cache write fused against
rotary then `write_kv`. CUDA only.
"""

from __future__ import annotations

import argparse
import json

import torch

from davit_engine.kernels.kv_cache import write_kv
from davit_engine.kernels.layer_ops import add_rms_norm, qk_norm_rope, rms_norm
from davit_engine.kernels.paged_attention import default_num_splits, paged_attention
from davit_tools.bench.timing import graph_us
from davit_tools.bench.workloads import W2

_W2 = W2()
_SHAPE = _W2.shape()
HIDDEN, HEADS, KV_HEADS = _SHAPE.hidden_size, _SHAPE.num_heads, _SHAPE.num_kv_heads
HEAD_DIM, INTER, VOCAB = _SHAPE.head_dim, _SHAPE.intermediate_size, _SHAPE.vocab_size
EPS = _SHAPE.rms_norm_eps


def _emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def gemm_table() -> None:
    dtype = torch.bfloat16
    shapes = {
        "qkv_proj": (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN),
        "o_proj": (HIDDEN, HEADS * HEAD_DIM),
        "gate_up_proj": (2 * INTER, HIDDEN),
        "down_proj": (HIDDEN, INTER),
        "lm_head": (VOCAB, HIDDEN),
    }
    for name, (n, k) in shapes.items():
        size = n * k * 2
        copies = [
            (0.02 * torch.randn(n, k, device="cuda")).to(dtype)
            for _ in range(max(1, -(-(256 << 20) // size)))
        ]
        for rows in (1, 8):
            x = torch.randn(rows, k, device="cuda", dtype=dtype)

            def run(x: torch.Tensor = x, weights: list[torch.Tensor] = copies) -> None:
                for w in weights:
                    torch.nn.functional.linear(x, w)

            us = graph_us(run, replays=10) / len(copies)
            _emit(section="gemm", layer=name, n=n, k=k, rows=rows, us=round(us, 2),
                  tb_per_s=round(size / us / 1e6, 3))  # fmt: skip


def attention() -> None:
    dtype = torch.bfloat16
    ctx, page = _W2.floor_context, 16
    blocks = ctx // page + 1
    cache = torch.randn(2, blocks, page, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
    tables = torch.randperm(blocks, device="cuda")[None].int()
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(1, HEADS, HEAD_DIM, device="cuda").to(dtype)
    kv_bytes = 2 * ctx * KV_HEADS * HEAD_DIM * 2
    for horizon in (2048, 8192):
        splits = default_num_splits(1, KV_HEADS, horizon, q.device)
        for num_splits in sorted({1, 8, 16, splits}):

            def run(n: int = num_splits) -> object:
                return paged_attention(q, cache, tables, lens, qsl, 1, HEAD_DIM**-0.5, n)

            us = graph_us(run)
            _emit(
                section="decode_attention",
                batch=1,
                context=ctx,
                heads=f"{HEADS}/{KV_HEADS}x{HEAD_DIM}",
                graph_horizon=horizon,
                num_splits=num_splits,
                default_for_horizon=num_splits == splits,
                us=round(us, 2),
                tb_per_s=round(kv_bytes / us / 1e6, 3),
            )


def elementwise() -> None:
    dtype = torch.bfloat16
    x = torch.randn(1, HIDDEN, device="cuda", dtype=dtype)
    residual = torch.randn(1, HIDDEN, device="cuda", dtype=dtype)
    weight = torch.ones(HIDDEN, device="cuda", dtype=dtype)
    fused = graph_us(lambda: add_rms_norm(x, residual, weight, EPS))
    separate = graph_us(lambda: rms_norm(x + residual, weight, EPS))
    _emit(section="add_rms_norm", rows=1, dim=HIDDEN, fused_us=round(fused, 2),
          add_then_norm_us=round(separate, 2))  # fmt: skip
    qkv = torch.randn(1, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    cos = torch.randn(1, HEAD_DIM, device="cuda", dtype=dtype)
    sin = torch.randn(1, HEAD_DIM, device="cuda", dtype=dtype)
    cache = torch.zeros(2, 64, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    slots = torch.tensor([37], dtype=torch.int64, device="cuda")

    def rope_then_write() -> None:
        q2, k2 = qk_norm_rope(q, k, cos, sin)
        assert k2 is not None
        write_kv(k2, v, cache, slots)

    fused_kv = graph_us(
        lambda: qk_norm_rope(q, k, cos, sin, v=v, kv_cache=cache, slot_mapping=slots)
    )
    _emit(section="rope_kv_write", rows=1, fused_us=round(fused_kv, 2),
          rope_then_write_us=round(graph_us(rope_then_write), 2))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default="gemm,attention,elementwise")
    args = parser.parse_args(argv)
    sections = {"gemm": gemm_table, "attention": attention, "elementwise": elementwise}
    _emit(section="config", device=torch.cuda.get_device_name(), torch=torch.__version__)
    for name in args.sections.split(","):
        sections[name]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
