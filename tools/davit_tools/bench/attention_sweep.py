"""Decode attention on a GPU: the engine's paged-attention kernel at its default launch beside
other key tiles, warp counts and pipeline depths, and, over an FP8 cache, with FP8 products
(queries rounded to e4m3 per row so keys enter the product unwidened; probabilities rounded to
e4m3 so values do), at W1's and W2's decode shapes.

    . hack/device/env.sh && python3 -m davit_tools.bench.attention_sweep

Each row: microseconds per call inside a CUDA graph (`timing.graph_us`), the KV bytes read per
second, and the relative error against the default launch's output over the same cache. Rows
are JSON lines in `$OUT/attention_sweep.jsonl`; the best setting per shape and cache is printed
last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

OUT = Path(os.environ.get("OUT", "/tmp/davit-attention-sweep"))

PRODUCTS = ((True, False), (False, True), (True, True))  # (FP8 q.k, FP8 p.v)
SHAPES = {  # label: (requests, context, query heads, KV heads)
    "w1": (256, 840, 16, 8),
    "w2": (1, 1152, 32, 8),
}


def _settings(text: str) -> list[tuple[int, int, int]]:
    """`64/4/2;128/4/1` -> [(block_n, warps, stages), ...]"""
    out = []
    for part in text.split(";"):
        if part.strip():
            n, w, s = (int(x) for x in part.split("/"))
            out.append((n, w, s))
    return out


def _inputs(label: str) -> dict[str, Any]:
    from davit_engine.kernels.kv_cache import write_kv
    from davit_engine.kernels.paged_attention import default_num_splits

    batch, ctx, hq, hkv = SHAPES[label]
    page, dim = 16, 128
    blocks_per = -(-ctx // page)
    num_blocks = batch * blocks_per
    gen = torch.Generator(device="cuda").manual_seed(0)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32, generator=gen)
    bf16 = torch.randn(
        2, num_blocks, page, hkv, dim, device="cuda", dtype=torch.bfloat16, generator=gen
    )
    kv_scale = torch.full((2, hkv), 4.0 / 448, device="cuda")
    fp8 = torch.empty_like(bf16, dtype=torch.float8_e4m3fn)
    flat = bf16.view(2, -1, hkv, dim)
    write_kv(flat[0], flat[1], fp8, torch.arange(num_blocks * page, device="cuda"), kv_scale)
    return {
        "q": torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16, generator=gen),
        "tables": tables.view(batch, blocks_per),
        "lens": torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        "qsl": torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        "splits": default_num_splits(batch, hkv, ctx, torch.device("cuda")),
        "caches": {"bf16": (bf16, None, 2), "fp8": (fp8, kv_scale, 1)},
        "kv_elements": batch * ctx * hkv * dim * 2,
        "dim": dim,
    }


def _attend(
    inp: dict[str, Any],
    name: str,
    launch: Any,
    qk: bool,
    pv: bool,
    pair: bool = False,
    prefetch: bool = False,
) -> torch.Tensor:
    from davit_engine.kernels import paged_attention as pa

    cache, kv_scale, _ = inp["caches"][name]
    saved = (pa.LAUNCH_OVERRIDE, pa.FP8_QK_DOT, pa.FP8_PV_DOT, pa.PAIR_DECODE, pa.PREFETCH_DECODE)
    pa.LAUNCH_OVERRIDE, pa.FP8_QK_DOT, pa.FP8_PV_DOT = launch, qk, pv
    pa.PAIR_DECODE, pa.PREFETCH_DECODE = pair, prefetch
    try:
        return pa.paged_attention(
            inp["q"], cache, inp["tables"], inp["lens"], inp["qsl"], 1, inp["dim"] ** -0.5,
            inp["splits"], kv_scale=kv_scale,
        )  # fmt: skip
    finally:
        pa.LAUNCH_OVERRIDE, pa.FP8_QK_DOT, pa.FP8_PV_DOT = saved[:3]
        pa.PAIR_DECODE, pa.PREFETCH_DECODE = saved[3:]


def sweep(
    label: str,
    settings: list[tuple[int, int, int]],
    caches: list[str],
    pair_settings: list[tuple[int, int, int]],
    fp8_products: bool,
    prefetch_settings: list[tuple[int, int, int]],
) -> list[dict]:
    from davit_tools.bench.timing import graph_us

    inp = _inputs(label)
    rows = []
    for name in caches:
        nbytes = inp["kv_elements"] * inp["caches"][name][2]
        reference = _attend(inp, name, None, False, False).float()
        variants = [(False, False, False, False, [None, *settings])]
        if name == "fp8" and fp8_products:
            variants += [(qk, pv, False, False, [None, *settings]) for qk, pv in PRODUCTS]
        if name == "fp8" and prefetch_settings:
            variants.append((False, False, False, True, prefetch_settings))
        hq, hkv = SHAPES[label][2:]
        if hq // hkv <= 2 and pair_settings:
            variants.append((False, False, True, False, pair_settings))
        for qk, pv, pair, prefetch, launches in variants:
            for launch in launches:
                kernel = "pair" if pair else "prefetch" if prefetch else "matrix-unit"
                row = {"shape": label, "cache": name, "splits": inp["splits"], "kernel": kernel,
                       "launch": "default" if launch is None else "/".join(map(str, launch)),
                       "fp8_qk": qk, "fp8_pv": pv}  # fmt: skip
                try:
                    out = _attend(inp, name, launch, qk, pv, pair, prefetch).float()
                    row["err"] = float((out - reference).norm() / reference.norm())
                    us = graph_us(
                        lambda n=name, la=launch, a=qk, b=pv, c=pair, d=prefetch: _attend(
                            inp, n, la, a, b, c, d
                        ),
                        20,
                    )
                    row["us"] = round(us, 2)
                    row["tb_s"] = round(nbytes / us / 1e6, 3)
                except Exception as exc:  # a setting that does not compile is a row, not a stop
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="w1,w2")
    parser.add_argument("--caches", default="bf16,fp8")
    parser.add_argument("--w1-settings", default="64/4/2;128/4/1;128/4/2;128/8/1;256/8/1")
    parser.add_argument("--w2-settings", default="32/4/1;64/4/2")
    parser.add_argument(
        "--pair-settings", default="32/4/1;64/4/1;64/4/2;128/4/1;64/8/1;128/8/1;32/2/1;64/2/1"
    )
    parser.add_argument("--fp8-products", action="store_true")
    parser.add_argument(
        "--prefetch-settings", default="128/4/1;64/4/1;32/4/1;128/8/1;64/8/1;64/2/1"
    )
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))
    started = time.monotonic()
    all_rows = []
    for label in args.shapes.split(","):
        settings = _settings(args.w1_settings if label == "w1" else args.w2_settings)
        all_rows += sweep(
            label, settings, args.caches.split(","), _settings(args.pair_settings),
            args.fp8_products, _settings(args.prefetch_settings),
        )  # fmt: skip
        torch.cuda.empty_cache()
    with open(OUT / "attention_sweep.jsonl", "a") as f:
        for row in all_rows:
            f.write(json.dumps(row) + "\n")
    print(f"# {len(all_rows)} rows in {time.monotonic() - started:.0f} s")
    for label in args.shapes.split(","):
        for name in args.caches.split(","):
            mine = [r for r in all_rows if r["shape"] == label and r["cache"] == name and "us" in r]
            base = next(
                r for r in mine
                if r["launch"] == "default" and r["kernel"] == "matrix-unit" and not r["fp8_qk"]
            )  # fmt: skip
            best = min(mine, key=lambda r: r["us"])
            print(
                f"{label} {name}: default {base['us']} us; best {best['us']} us "
                f"({best['kernel']} {best['launch']}, fp8 qk {best['fp8_qk']}, fp8 pv {best['fp8_pv']}, "
                f"err {best['err']:.2e}) = {base['us'] / best['us']:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
