"""FP8 on the GPU, in one call: kernel tests, kernel timings, W1/W2 in bf16 beside FP8, and the
memory check with an FP8 KV cache.

    . hack/device/env.sh && python3 -m davit_tools.bench.fp8 --sections tests,gemm,attention,w2,w1,memory

Sections (each runs on its own; a failing one is reported and the next runs):
- `tests`: the FP8 kernel and module tests with their `gpu` cases (pytest, on this GPU);
- `gemm`: one projection at W2's shapes (Llama-3.1-8B: qkv, o, gate_up, down) and 1 / 2 / 4 /
  8 / 16 / 256 rows, inside CUDA graphs with weights cycled beyond L2: the bf16 library GEMM,
  the engine's default FP8 weight-only product, the matrix-vector kernel's tiles
  (`--gemv-configs`, up to 8 rows; a fifth field streams W at one row through that many
  pipeline stages, a sixth (1) fetches its first tile before the PDL wait), the matrix-unit
  kernel's tiles (`--gemm-configs`), and
  per-token quantization + `torch._scaled_mm`; each FP8 result's error against the
  dequantized product and its FP8 bytes per second; a `gemm_best` row per shape and row count
  names the fastest FP8 weight-only variant; at gate_up and one or two rows also the product
  with SiLU x up in its epilogue (`act_gated_us`) against the product then `silu_mul`;
- `attention`: decode attention at W1's shape (B 256, context 840, 16/8 heads x 128), a W1
  tail step's (B 64, context 1500, two splits) and W2's (B 1, context 1152, 32/8 x 128) over a
  bf16 and an FP8 cache (write included separately); FP8 as the V2 runner launches it
  (queries rotated beforehand), with the kernel rotating the queries itself (`fp8_q_tile`),
  without the register cap (`fp8_uncapped`), and at split shapes at other split counts
  (`*_s{N}`);
- `w2`: W2 through the engine loop (V2, CUDA graphs, async) in bf16, then with FP8 weights and
  an FP8 KV cache (`--w2-variants`; `fp8-both-separate-silu` runs SiLU x up as its own kernel
  instead of in the gate/up product's, `fp8-both-stream{3,4}[-preload]` streams W in the
  one-row products), decode tok/s
  against each one's bandwidth floor, and whether the greedy tokens agree;
- `w1`: W1 the same way, bf16 then an FP8 KV cache (`--w1-variants`: also split targets
  `*-splits-528` / `*-splits-1056` / `*-splits-2112`, `*-split-past-wave`, balanced splits
  `*-balanced`, and the FP8 rotary kernel's launch `fp8-kv-rotary-{4w,reg,4w-reg}` (`4w-reg`:
  the launch before run 24)); with `--rounds N` both W1 and W2 run
  their variants N times, interleaved, and record each variant's median, minimum, maximum and
  median over the first variant's (`w1-rounds`, `w2-rounds`); a variant may join several with
  "+" (`fp8-both-stream4-preload+fp8-both-lm-head`: their switches together);
- `w1-prefill`: W1's prompts alone (one output token each), per `--w1-variants` (and
  `--rounds`): the prefill part of W1, prompt tokens per second;
- `decode-tiles`: the FP8 cache's decode launch at W1's shape and four W1 steps in each tile of
  `--tile-configs` (W1 variants `fp8-kv-tile-{block}x{warps}x{stages}[-nocap]` run one);
- `rotary`: the FP8 cache's rotary kernel at a W1 decode step, a W1 prefill chunk and W2's
  token, one token a program and in token groups (`--rotary-configs`), beside the bf16 cache's;
- `w1-trajectory`: decode attention at W1 steps with their real spread of contexts, bf16 and
  FP8, split as the engine does, FP8 at twice the engine's waves, balanced, and at the mean
  context;
- `w1-profile`: one W1 run per variant under the torch profiler: GPU busy time (the union of
  kernel intervals), the largest kernels' totals, and the attention, rotary and merge
  kernels' launches grouped by launch shape (`launch_groups`);
- `memory`: `davit_tools.bench.memory_check` with `--kv-cache-dtype fp8` in a subprocess;
- `quality`: the quality figures of `tests/engine/quant/test_quality_smollm2.py` on this GPU
  (SmolLM2-135M from `--smollm2-gguf`, bf16, the GPU kernels: Triton attention, the FP8
  products): perplexity of the test's text and greedy agreement with bf16 per configuration.

Every result is a JSON line in `$OUT/fp8.jsonl` with its configuration; a table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from davit_tools.bench.workloads import W1, W2, OfflineWorkload, model_shape

OUT = Path(os.environ.get("OUT", "/tmp/davit-fp8"))
ROWS: list[dict[str, Any]] = []
W2_SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


def record(section: str, **fields: Any) -> None:
    row = {"section": section, **fields}
    ROWS.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "fp8.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def versions() -> dict[str, str]:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


# ---- tests --------------------------------------------------------------------------------------

TEST_PATHS = (
    "tests/engine/kernels/test_fp8.py",
    "tests/engine/kernels/test_fp8_linear.py",
    "tests/engine/kernels/test_fp8_gemv.py",
    "tests/engine/kernels/test_kv_cache.py",
    "tests/engine/kernels/test_paged_attention.py",
    "tests/engine/kernels/test_layer_ops.py",
    "tests/engine/kernels/test_fp8_mlp_block.py",
    "tests/engine/quant/test_fp8_linear.py",
    "tests/engine/quant/test_fp8_kv_engine.py",
    "tests/engine/quant/test_block_fp8.py",
    "tests/engine/runner/v2/test_fused_layers.py",
    "tests/engine/runner/v2/test_graph_logits.py",
)


def section_tests(args: argparse.Namespace) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *shlex.split(args.tests_args),
        *TEST_PATHS,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tests_timeout_s)
    (OUT / "tests.log").write_text(done.stdout + done.stderr)
    summary = [line for line in done.stdout.splitlines() if " passed" in line or " failed" in line]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    record("tests", returncode=done.returncode, summary=summary[-1:] or done.stdout[-300:],
           failed=failed[:20])  # fmt: skip


# ---- kernels ------------------------------------------------------------------------------------


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _parse_configs(text: str) -> list[Any]:
    """`BLOCK_N/BLOCK_K/WARPS/STAGES;...` -> MatmulConfigs (rows tile 16)."""
    from davit_engine.kernels.fp8_linear import MatmulConfig

    configs = []
    for item in filter(None, text.split(";")):
        fields = item.split("/")
        if len(fields) != 4 or not all(v.isdigit() for v in fields):
            raise ValueError(f"--gemm-configs: {item!r} is not BLOCK_N/BLOCK_K/WARPS/STAGES")
        n, k, w, s = (int(v) for v in fields)
        configs.append(MatmulConfig(block_m=16, block_n=n, block_k=k, num_warps=w, num_stages=s))
    return configs


def _parse_gemv_configs(text: str) -> list[Any]:
    """`BLOCK_N/BLOCK_K/WARPS/SPLIT_K[/STAGES[/PRELOAD[/UNROLL]]];...` -> GemvConfigs (SPLIT_K
    0: the engine's choice; STAGES >= 2: W streamed through that many pipeline stages at one
    row; PRELOAD 1: at one row, the first tile of W fetched before the wait for the kernel
    before, streamed or with the plain loads; UNROLL 2: at one row with the plain loads, two K
    steps' loads a round)."""
    from davit_engine.kernels.fp8_gemv import GemvConfig

    configs = []
    for item in filter(None, text.split(";")):
        fields = item.split("/")
        if not 4 <= len(fields) <= 7 or not all(v.isdigit() for v in fields):
            raise ValueError(
                f"--gemv-configs: {item!r} is not "
                "BLOCK_N/BLOCK_K/WARPS/SPLIT_K[/STAGES[/PRELOAD[/UNROLL]]]"
            )
        n, k, w, split, stages, preload = (int(v) for v in (fields + ["0"] * 6)[:6])
        unroll = int(fields[6]) if len(fields) == 7 else 1
        if stages == 1 or preload not in (0, 1) or unroll not in (1, 2):
            raise ValueError(
                f"--gemv-configs: {item!r}: STAGES is 0 (plain loads) or at least 2, PRELOAD 0 "
                "or 1, UNROLL 1 or 2"
            )
        config = GemvConfig(n, k, w, split_k=split, stages=stages, preload=preload, unroll=unroll)
        configs.append(config)
    return configs


def _label(cfg: Any) -> str:
    from davit_engine.kernels.fp8_gemv import GemvConfig

    if isinstance(cfg, GemvConfig):
        return cfg.label
    return f"triton_{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}"


# The `_weight_only` config that runs the engine's many-row weight-only product
# (`dequantized_matmul`) instead of a Triton tile.
DEQUANTIZED = "dequantized"


def _weight_only(
    x: torch.Tensor, fp8: list[torch.Tensor], scales: list[torch.Tensor], config: Any, i: int
) -> torch.Tensor:
    from davit_engine.kernels.fp8_linear import fp8_weight_matmul

    if config == DEQUANTIZED:  # W widened to x's dtype, the library GEMM, then scaled
        from davit_engine.kernels.fp8_linear import dequantized_matmul

        return dequantized_matmul(x, fp8[i], scales[i])
    return fp8_weight_matmul(x, fp8[i], scales[i], config=config)


def _gemm_rows(
    name: str, bf16: list[torch.Tensor], fp8: list[torch.Tensor], scales: list[torch.Tensor],
    rows: int, extra: list[Any], gemv: list[Any],
) -> dict[str, Any]:  # fmt: skip
    """One projection shape at `rows` rows: bf16 library GEMM, FP8 weight-only tiles, per-token
    quantization + torch._scaled_mm; weights cycled over the copies."""
    from davit_engine.kernels import fp8_gemv
    from davit_engine.kernels.fp8_linear import (
        default_config,
        fp8_weight_matmul_reference,
        quantize_rows,
    )
    from davit_tools.bench.timing import graph_us

    n, k = fp8[0].shape
    copies = len(fp8)
    x = torch.randn(rows, k, device=fp8[0].device, dtype=torch.bfloat16)
    turn = [0]

    def cycled(fn: Callable[[int], Any]) -> Callable[[], Any]:
        def call() -> Any:
            turn[0] = (turn[0] + 1) % copies
            return fn(turn[0])

        return call

    def scaled(i: int) -> torch.Tensor:
        q, s = quantize_rows(x)
        return torch._scaled_mm(
            q, fp8[i].t(), scale_a=s, scale_b=scales[i].view(1, -1), out_dtype=torch.bfloat16
        )

    row: dict[str, Any] = {"shape": name, "n": n, "k": k, "rows": rows}
    row["bf16_us"] = round(
        graph_us(cycled(lambda i: torch.nn.functional.linear(x, bf16[i])), 20), 2
    )
    ref = fp8_weight_matmul_reference(x.float(), fp8[0], scales[0])
    fp8_bytes = n * k + 4 * n
    weight_only: dict[str, float] = {}
    # Past 16 rows the engine quantizes the activations and calls torch._scaled_mm (below),
    # except for the projections of quant/fp8_linear.UNQUANTIZED_INPUTS (q/k/v), which keep
    # the weight-only product at every row count: "default" is the matrix-unit tile there,
    # "dequantized" the library GEMM on W widened to bf16 (from Fp8Linear.dequantize_min_rows
    # rows on, the engine's choice).
    candidates: list[tuple[str, Any]] = [("default", None)]
    if rows > 16:
        candidates += [(DEQUANTIZED, DEQUANTIZED)]
    if rows <= 8:
        candidates += [(_label(cfg), cfg) for cfg in gemv]
    if fp8_gemv.MAX_ROWS < rows <= 16:
        candidates += [(_label(default_config(rows)), default_config(rows))]
    if rows <= 16:
        candidates += [(_label(cfg), cfg) for cfg in extra]
    for label, cfg in candidates:
        try:
            err = _rel_err(_weight_only(x, fp8, scales, cfg, 0), ref)
            us = graph_us(cycled(functools.partial(_weight_only, x, fp8, scales, cfg)), 20)
            row[label + "_us"] = round(us, 2)
            row[label + "_tb_s"] = round(fp8_bytes / us / 1e6, 2)
            row[label + "_err"] = round(err, 5)
            weight_only[label] = us
        except Exception as exc:  # a tile that does not compile here: report, go on
            row[label + "_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    if name == "gate_up" and rows <= fp8_gemv.MAX_ROWS:  # SiLU x up: in the epilogue or not
        row.update(_activation_timings(x, fp8, scales, cycled))
    if weight_only:
        best = min(weight_only, key=lambda key: weight_only[key])
        row["best"] = best
        row["best_us"] = round(weight_only[best], 2)
    try:
        row["scaled_mm_err"] = round(_rel_err(scaled(0), ref), 5)
        row["scaled_mm_us"] = round(graph_us(cycled(scaled), 20), 2)
    except Exception as exc:
        row["scaled_mm_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return row


def _activation_timings(
    x: torch.Tensor, fp8: list[torch.Tensor], scales: list[torch.Tensor],
    cycled: Callable[[Callable[[int], Any]], Callable[[], Any]],
) -> dict[str, Any]:  # fmt: skip
    """A gate/up product with SiLU x up in its epilogue against the product then `silu_mul`."""
    from davit_engine.kernels.fp8_gemv import fp8_gemv
    from davit_engine.kernels.layer_ops import silu_mul
    from davit_tools.bench.timing import graph_us

    def separate(i: int) -> torch.Tensor:
        return silu_mul(fp8_gemv(x, fp8[i], scales[i]))

    def gated(i: int) -> torch.Tensor:
        return fp8_gemv(x, fp8[i], scales[i], gated=True)

    return {
        "act_separate_us": round(graph_us(cycled(separate), 20), 2),
        "act_gated_us": round(graph_us(cycled(gated), 20), 2),
        "act_gated_equal": bool(torch.equal(gated(0), separate(0))),
    }


def _per_channel_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` in e4m3 with one float32 scale per row (its largest value at FP8's largest)."""
    from davit_engine.layers.fp8 import FP8_MAX, quantize_fp8

    scale = w.float().abs().amax(dim=1) / FP8_MAX
    return quantize_fp8(w, scale[:, None]), scale


def section_gemm(args: argparse.Namespace) -> None:
    extra = _parse_configs(args.gemm_configs)
    gemv = _parse_gemv_configs(args.gemv_configs)
    for name, (n, k) in W2_SHAPES.items():
        copies = max(2, -(-400_000_000 // (n * k * 2)))  # bf16 copies well beyond L2
        bf16 = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        fp8, scales = (list(t) for t in zip(*(_per_channel_fp8(w) for w in bf16), strict=True))
        for rows in (int(r) for r in args.gemm_rows.split(",")):
            gemm_row = _gemm_rows(name, bf16, fp8, scales, rows, extra, gemv)
            record("gemm", **gemm_row)
        bf16.clear()
        fp8.clear()
        torch.cuda.empty_cache()


def section_mlp_block(args: argparse.Namespace) -> None:
    """A decoder layer's second half at one token (o projection, add + RMSNorm, FP8 gate/up
    with SiLU x up, down, add + RMSNorm) at Llama-3.1-8B's shapes: the five unfused kernels
    against the persistent block (kernels/fp8_mlp_block.py) at several programs a
    multiprocessor, 32 layers back to back in one graph, the layers' weights cycled beyond
    L2; both forms' outputs compared bit for bit first."""
    import itertools

    from davit_engine.kernels import fp8_mlp_block as mb
    from davit_engine.kernels.fp8_gemv import fp8_gemv
    from davit_engine.kernels.layer_ops import add_rms_norm
    from davit_tools.bench.timing import graph_us

    dev = torch.device("cuda")
    h, inter = W2_SHAPES["o"][0], W2_SHAPES["down"][1]
    copies = 6  # 6 x 193 MB of FP8 weights

    def fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _per_channel_fp8(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, device=dev)).to(torch.bfloat16)

    layers = [
        mb.MlpBlockWeights(
            *fp8_weight(h, h),
            norm(),
            1e-5,
            *fp8_weight(2 * inter, h),
            *fp8_weight(h, inter),
            norm(),
            1e-5,
        )  # fmt: skip
        for _ in range(copies)
    ]
    attn = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    counters = mb.new_counters(dev)

    def unfused(w: mb.MlpBlockWeights) -> tuple[torch.Tensor, torch.Tensor]:
        o = fp8_gemv(attn, w.o_weight, w.o_scale)
        x1, s1 = add_rms_norm(o, residual, w.post_norm, w.post_eps)
        act = fp8_gemv(x1, w.gate_up_weight, w.gate_up_scale, gated=True)
        return add_rms_norm(fp8_gemv(act, w.down_weight, w.down_scale), s1, w.next_norm, 1e-5)

    cycle = itertools.cycle(layers)
    weight_bytes = sum(
        t.numel() for t in (layers[0].o_weight, layers[0].gate_up_weight, layers[0].down_weight)
    )
    row: dict[str, Any] = {"shape": f"hidden {h}, intermediate {inter}", "layers": 32,
                           "weight_copies": copies, "weight_mb": round(weight_bytes / 1e6, 1)}  # fmt: skip
    fused = mb.fp8_mlp_block(attn, residual, layers[0], counters)
    torch.cuda.synchronize()
    row["bit_equal"] = all(
        torch.equal(a, b) for a, b in zip(fused, unfused(layers[0]), strict=True)
    )
    row["unfused_us"] = round(graph_us(lambda: unfused(next(cycle)), 32), 2)
    row["unfused_tb_s"] = round(weight_bytes / row["unfused_us"] / 1e6, 3)
    switches = ("PROGRAMS_PER_SM", "X_CG", "K_UNROLL", "MAX_REGISTERS")
    defaults = {name: getattr(mb, name) for name in switches}
    # (label, programs a multiprocessor at most, x through L2 only, K steps a load round,
    # registers a thread at most)
    forms: list[tuple[str, int, bool, int, int | None]] = [
        ("default", 8, False, 1, 64),
        ("no_register_cap", 8, False, 1, None),
        ("unroll2", 8, False, 2, 64),
        ("x_cg", 8, True, 1, 64),
        ("4_a_multiprocessor", 4, False, 1, 64),
    ]
    try:
        for label, per_sm, x_cg, unroll, registers in forms:
            for name, value in zip(switches, (per_sm, x_cg, unroll, registers), strict=True):
                setattr(mb, name, value)
            us = graph_us(lambda: mb.fp8_mlp_block(attn, residual, next(cycle), counters), 32)
            row[f"{label}_us"] = round(us, 2)
            row[f"{label}_programs"] = mb.last_programs
            row[f"{label}_tb_s"] = round(weight_bytes / us / 1e6, 3)
            if label in ("default", "no_register_cap"):
                row.update(_block_timeline(mb, attn, residual, layers, counters, label))
    finally:
        for name, value in defaults.items():
            setattr(mb, name, value)
    torch.cuda.synchronize()
    row["waits_given_up"] = int(counters[mb._C_ERROR])
    record("mlp-block", **row, **versions())


def _block_timeline(
    mb: Any,
    attn: torch.Tensor,
    residual: torch.Tensor,
    layers: list[Any],
    counters: torch.Tensor,
    label: str,
) -> dict[str, float]:
    """The persistent block's phases in time: 32 launches in one graph, each writing every
    program's timer stamps; for each stamp, when the last program passed it, from the first
    program's start (us, the median over launches 8-31), and how far apart the programs
    started."""
    import statistics

    launches = 32
    rows = 32 * torch.cuda.get_device_properties(attn.device).multi_processor_count
    trace = torch.zeros(launches, rows, mb.TRACE_SLOTS, dtype=torch.int64, device=attn.device)
    mb.fp8_mlp_block(attn, residual, layers[0], counters, trace=trace[0])  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            mb.fp8_mlp_block(attn, residual, layers[i % len(layers)], counters, trace=trace[i])
    graph.replay()
    torch.cuda.synchronize()
    stamps = trace[:, : mb.last_programs].double() / 1e3  # us
    start = stamps[:, :, 0].min(dim=1).values  # [launches]
    names = ("o", "barrier", "norm", "gate_up", "barrier2", "down", "end")
    out: dict[str, float] = {}
    for slot, name in enumerate(names, start=1):
        last = stamps[:, :, slot].max(dim=1).values - start
        out[f"{label}_t_{name}_us"] = round(statistics.median(last[8:].tolist()), 2)
    spread = stamps[:, :, 0].max(dim=1).values - start
    out[f"{label}_start_spread_us"] = round(statistics.median(spread[8:].tolist()), 2)
    return out


def _attention_shape(
    label: str, batch: int, ctx: int, hq: int, hkv: int, device: str = "cuda",
    splits: int | None = None, sweep_splits: tuple[int, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    from davit_engine.kernels import paged_attention as pa
    from davit_engine.kernels.kv_cache import write_kv
    from davit_tools.bench.timing import graph_us

    dim = 128
    q, bf16, fp8, kv_scale, tables, lens, qsl = _paged_batch([ctx] * batch, hq, hkv, device, dim)
    splits = splits or pa.default_num_splits(batch, hkv, ctx, q.device)
    row: dict[str, Any] = {"shape": label, "batch": batch, "context": ctx,
                           "heads": f"{hq}/{hkv}x{dim}", "splits": splits}  # fmt: skip
    kv_bytes = batch * ctx * hkv * dim * 2
    # fp8: as the V2 runner launches it, the queries rotated by the rotary kernel beforehand;
    # fp8_q_tile: the kernel rotating them itself; fp8_uncapped: the first without its
    # register cap (its timing does not depend on q's values)
    timed = [
        ("bf16", bf16, None, 2, False, True),
        ("fp8", fp8, kv_scale, 1, True, True),
        ("fp8_q_tile", fp8, kv_scale, 1, False, True),
        ("fp8_uncapped", fp8, kv_scale, 1, True, False),
    ]

    def attend(cache: torch.Tensor, scale: Any, num_splits: int, **options: Any) -> Any:
        return functools.partial(pa.paged_attention, q, cache, tables, lens, qsl, 1,
                                 dim**-0.5, num_splits, kv_scale=scale, **options)  # fmt: skip

    cap = pa._FP8_DECODE_MAX_REGISTERS
    for name, cache, scale, element, rotated, capped in timed:
        launch = attend(cache, scale, splits, queries_rotated=rotated)
        pa._FP8_DECODE_MAX_REGISTERS = cap if capped else None
        try:
            us = graph_us(launch, 20)
        finally:
            pa._FP8_DECODE_MAX_REGISTERS = cap
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_tb_s"] = round(kv_bytes * element / us / 1e6, 3)
    row["fp8_register_cap"] = cap
    row["speedup"] = round(row["bf16_us"] / row["fp8_us"], 3)
    # other split counts than the engine's at split shapes (the key tiles are what a split
    # owns: W2's 1,152 keys are 18 FP8 tiles, which 16 splits cover with 9 programs of two)
    for other in sweep_splits if splits > 1 else ():
        for name, cache, scale, rotated in (
            ("bf16", bf16, None, False),
            ("fp8", fp8, kv_scale, True),
        ):
            launch = attend(cache, scale, other, queries_rotated=rotated)
            row[f"{name}_s{other}_us"] = round(graph_us(launch, 20), 2)
    k_new = torch.randn(batch, hkv, dim, device=device, dtype=torch.bfloat16)
    slots = torch.arange(batch, device=device)  # the first slots: one new token per request
    row["write_fp8_us"] = round(
        graph_us(lambda: write_kv(k_new, k_new, fp8, slots, kv_scale), 20), 2
    )
    row["write_bf16_us"] = round(graph_us(lambda: write_kv(k_new, k_new, bf16, slots), 20), 2)
    return row


def section_attention(args: argparse.Namespace) -> None:
    shapes = (
        ("w1", 256, 840, 16, 8, ()),
        ("w1_tail", 64, 1500, 16, 8, (4,)),  # a step of W1's last requests: two splits
        ("w2", 1, 1152, 32, 8, (8, 24, 32)),
    )
    for label, batch, ctx, hq, hkv, sweep in shapes:
        record("attention", **_attention_shape(label, batch, ctx, hq, hkv, sweep_splits=sweep))
        torch.cuda.empty_cache()


# FP8 decode tiles the `decode-tiles` section times: key tile / warps / pipeline stages /
# register cap (0: none). The first is the engine's launch.
DECODE_TILE_CONFIGS = (
    "64/2/2/128;64/2/3/128;64/2/1/128;64/4/2/128;64/4/3/128;128/2/2/128;128/4/2/128;"
    "128/4/3/128;32/2/2/128;32/2/3/128;64/2/2/0;128/8/2/128"
)


@contextlib.contextmanager
def switched(switches: tuple[tuple[str, str, object], ...]) -> Iterator[None]:
    """Engine module attributes set to the given values (module, attribute, value) while the
    block runs, restored afterwards in reverse order."""
    before: list[tuple[Any, str, object]] = []
    try:
        for module_name, attribute, value in switches:
            module = importlib.import_module(module_name)
            before.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, value)
        yield
    finally:
        for module, attribute, value in reversed(before):
            setattr(module, attribute, value)


def _tile_switches(spec: str) -> tuple[tuple[str, str, object], ...]:
    """`paged_attention` switches for an FP8 decode tile given as `block/warps/stages/cap`."""
    block, warps, stages, cap = (int(v) for v in spec.split("/"))
    module = "davit_engine.kernels.paged_attention"
    return (
        (module, "_FP8_DECODE_BLOCK_N", block),
        (module, "_FP8_DECODE_NUM_WARPS", warps),
        (module, "_FP8_DECODE_STAGES", stages),
        (module, "_FP8_DECODE_MAX_REGISTERS", cap or None),
    )


def _tile_variant_switches(spec: str) -> tuple[tuple[str, str, object], ...]:
    """The switches of `_tile_switches(spec)` that differ from the engine's tile (the first of
    `DECODE_TILE_CONFIGS`): a variant sets only what it changes."""
    engine = dict(((m, a), v) for m, a, v in _tile_switches(DECODE_TILE_CONFIGS.split(";")[0]))
    return tuple(sw for sw in _tile_switches(spec) if engine[sw[0], sw[1]] != sw[2])


def _tile_variants() -> dict[str, Variant]:
    """FP8 KV and FP8 weights + KV variants in each decode tile of 32/64/128 keys, 2/4/8
    warps, 1-3 stages, capped at 128 registers or not (`-nocap`), but the engine's own."""
    out: dict[str, Variant] = {}
    for block in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (1, 2, 3):
                for cap in (128, 0):
                    switches = _tile_variant_switches(f"{block}/{warps}/{stages}/{cap}")
                    suffix = f"tile-{block}x{warps}x{stages}{'' if cap else '-nocap'}"
                    for base, quantization, kv in _BASES:
                        if kv == "fp8" and switches:
                            name = f"{base}-{suffix}"
                            out[name] = Variant(name, quantization, kv, switches)
    return out


def section_decode_tiles(args: argparse.Namespace) -> None:
    """The FP8 cache's unsplit / few-split decode launch (queries rotated, the engine's
    splits) at W1's uniform shape and at W1 steps with their real contexts, in each tile of
    `--tile-configs` (a compile failure is recorded, not raised)."""
    from davit_engine.kernels import paged_attention as pa
    from davit_tools.bench.timing import graph_us

    dev = torch.device("cuda")
    hq, hkv, dim = 16, 8, 128
    cases = [("w1", [840] * 256)] + [
        (f"step{step}", w1_decode_step(step)) for step in (50, 350, 650, 800)
    ]
    batches = {}
    for label, contexts in cases:
        q, _, fp8, kv_scale, tables, lens, qsl = _paged_batch(contexts, hq, hkv, "cuda", dim)
        splits = pa.default_num_splits(len(contexts), hkv, 2048, dev, fp8=True)
        kv_bytes = sum(contexts) * hkv * dim * 2
        batches[label] = (q, fp8, kv_scale, tables, lens, qsl, splits, kv_bytes)
    reference: dict[str, torch.Tensor] = {}
    for spec in args.tile_configs.split(";"):
        row: dict[str, Any] = {"tile": spec}
        with switched(_tile_switches(spec)):
            for label, (q, fp8, kv_scale, tables, lens, qsl, splits, kv_bytes) in batches.items():
                launch = functools.partial(
                    pa.paged_attention, q, fp8, tables, lens, qsl, 1, dim**-0.5, splits,
                    kv_scale=kv_scale, queries_rotated=True,
                )  # fmt: skip
                try:  # a tile that does not compile (shared memory) is recorded as such
                    us = graph_us(launch, 10)
                except Exception as error:
                    row[f"{label}_error"] = f"{type(error).__name__}: {str(error)[:160]}"
                    break
                out = launch().float()
                if label not in reference:  # the first tile's output: the others' reference
                    reference[label] = out
                row[f"{label}_max_diff"] = float((out - reference[label]).abs().max())
                row[f"{label}_us"] = round(us, 2)
                row[f"{label}_tb_s"] = round(kv_bytes / us / 1e6, 3)
                row[f"{label}_splits"] = splits
        record("decode-tiles", **row)


# The rotary kernel's launches the `rotary` section times: (label, tokens, query heads, KV
# heads): a W1 decode step and prefill chunk (Qwen3-0.6B, q/k norms), W2's one token
# (Llama-3.1-8B)
ROTARY_CASES = (("w1-decode", 256, 16, 8), ("w1-prefill", 8192, 16, 8), ("w2", 1, 32, 8))
# Token groups the `rotary` section times, GROUP/WARPS (`layer_ops.ROTARY_TOKEN_GROUP`, 0:
# chosen per launch, the engine's; `ROTARY_GROUP_NUM_WARPS`); the first, one token a program,
# is the reference the others' numbers are compared with
ROTARY_GROUP_CONFIGS = "1/8;0/8;2/8;4/8;2/16;4/16;8/16"


def section_rotary(args: argparse.Namespace) -> None:
    """The rotary kernel as the V2 runner launches it for an FP8 cache (norms, rotary, queries
    times H, keys times H quantized into the cache with the values) at `ROTARY_CASES`, one
    token a program against token groups (`--rotary-configs`), and the same launch for a bf16
    cache (no rotation) beside it; each group's rotated queries and cache bytes compared with
    the first configuration's."""
    for label, tokens, hq, hkv in ROTARY_CASES:
        record("rotary", **_rotary_row(label, tokens, hq, hkv, args.rotary_configs.split(";")))
        torch.cuda.empty_cache()


class RotaryStep(NamedTuple):
    """A rotary launch's inputs (`rotary_step`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    weights: torch.Tensor  # [2, D]: the q and k norm weights
    slots: torch.Tensor
    kv_scale: torch.Tensor  # an FP8 cache's [2, Hkv] scales
    caches: dict[bool, torch.Tensor]  # an empty cache of each kind, keyed by "FP8"


def rotary_step(tokens: int, hq: int, hkv: int) -> RotaryStep:
    """A rotary launch's inputs on the GPU (seeded): q, k and v as views of one projection
    (`tokens` x heads of 128, bf16), cos, sin, the q/k norm weights, each token's cache slot,
    an FP8 cache's scales and an empty cache of each kind."""
    dim, page = 128, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(tokens, hq + 2 * hkv, dim, device="cuda", generator=gen).to(torch.bfloat16)
    angles = torch.rand(tokens, dim // 2, device="cuda", generator=gen) * 6.28
    weights = (1 + 0.1 * torch.randn(2, dim, device="cuda", generator=gen)).to(torch.bfloat16)
    blocks = tokens // page + 4
    return RotaryStep(
        q=qkv[:, :hq],
        k=qkv[:, hq : hq + hkv],
        v=qkv[:, hq + hkv :],
        cos=torch.cat((angles, angles), -1).cos().to(torch.bfloat16),
        sin=torch.cat((angles, angles), -1).sin().to(torch.bfloat16),
        weights=weights,
        slots=torch.randperm(blocks * page, device="cuda", generator=gen)[:tokens],
        kv_scale=torch.full((2, hkv), 0.05, device="cuda"),
        caches={
            fp8: torch.zeros(2, blocks, page, hkv, dim, device="cuda").to(
                torch.float8_e4m3fn if fp8 else torch.bfloat16
            )
            for fp8 in (False, True)
        },
    )


def _rotary_row(label: str, tokens: int, hq: int, hkv: int, configs: list[str]) -> dict[str, Any]:
    from davit_engine.kernels import layer_ops
    from davit_tools.bench.timing import graph_us

    dim = 128
    q, k, v, cos, sin, weights, slots, kv_scale, caches = rotary_step(tokens, hq, hkv)

    def launch(fp8: bool) -> torch.Tensor:
        out, _ = layer_ops.qk_norm_rope(
            q, k, cos, sin, weights[0], weights[1], 1e-6, v=v, kv_cache=caches[fp8],
            slot_mapping=slots, kv_scale=kv_scale if fp8 else None, rotate_queries=fp8,
        )  # fmt: skip
        return out

    row: dict[str, Any] = {"case": label, "tokens": tokens, "heads": f"{hq}/{hkv}x{dim}"}
    row["bf16_us"] = round(graph_us(lambda: launch(False), 20), 2)
    reference: tuple[torch.Tensor, torch.Tensor] | None = None
    for spec in configs:
        group, warps = (int(part) for part in spec.split("/"))
        module = "davit_engine.kernels.layer_ops"
        with switched(
            ((module, "ROTARY_TOKEN_GROUP", group), (module, "ROTARY_GROUP_NUM_WARPS", warps))
        ):
            key = f"g{group}w{warps}"
            row[f"{key}_us"] = round(graph_us(lambda: launch(True), 20), 2)
            row[f"{key}_group"] = layer_ops.rotary_token_group(tokens)
            caches[True].zero_()
            out = launch(True).float()
            cache = caches[True].view(torch.uint8).int()
            if reference is None:
                reference = (out, cache)
            row[f"{key}_query_diffs"] = int((out != reference[0]).sum())
            row[f"{key}_cache_diffs"] = int((cache != reference[1]).sum())
    return row


# W1 decode steps the trajectory section times (steps after the prompts: requests whose
# output is longer are still running, each at its prompt plus the step's keys)
W1_TRAJECTORY_STEPS = (50, 200, 350, 500, 650, 800, 950)


def w1_decode_step(step: int) -> list[int]:
    """The contexts of W1's running requests at decode step `step` (W1's own lengths)."""
    inputs, outputs = W1().lengths()
    return [i + step for i, o in zip(inputs, outputs, strict=True) if o > step]


def _paged_batch(
    contexts: list[int], hq: int, hkv: int, device: str, dim: int = 128, page: int = 16
) -> tuple[torch.Tensor, ...]:
    """Decode rows at `contexts` over a bf16 cache and its FP8 copy (blocks shuffled): q, the
    two caches, the FP8 scales, block tables, lengths and query starts."""
    from davit_engine.kernels.kv_cache import write_kv

    batch = len(contexts)
    blocks = [-(-c // page) for c in contexts]
    num_blocks = sum(blocks)
    order = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    tables = torch.full((batch, max(blocks)), -1, dtype=torch.int32, device=device)
    start = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = order[start : start + n]
        start += n
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, dim, device=device, dtype=torch.bfloat16)
    bf16 = torch.randn(2, num_blocks, page, hkv, dim, device=device, dtype=torch.bfloat16)
    kv_scale = torch.full((2, hkv), 4.0 / 448, device=device)
    fp8 = torch.empty_like(bf16, dtype=torch.float8_e4m3fn)
    flat = bf16.view(2, -1, hkv, dim)
    write_kv(flat[0], flat[1], fp8, torch.arange(num_blocks * page, device=device), kv_scale)
    return q, bf16, fp8, kv_scale, tables, lens, qsl


def _balanced_launch(
    requests: int, hkv: int, horizon: int, device: torch.device, fp8: bool, waves: float
) -> tuple[int, int]:
    """(grid splits, programs) of a balanced split decode at `waves` waves of the tile's
    programs, as the engine would launch it with `BALANCE_SPLITS` on."""
    from davit_tools.bench.split_model import engine_settings

    with engine_settings(fp8, balanced=waves) as pa:
        grid = pa.default_num_splits(requests, hkv, horizon, device, fp8=fp8)
        return grid, pa.balanced_split_programs(device, fp8)


def _split_model_units(
    contexts: list[int], hkv: int, splits: int, programs: int | None, fp8: bool,
    device: torch.device,
) -> float:  # fmt: skip
    """The split model's figure for one launch (`davit_tools.bench.split_model`, its default
    costs), in thousands of key units: beside each timing, so that a run can fit the model's
    per-program cost."""
    from davit_engine.kernels import paged_attention as pa
    from davit_tools.bench import split_model

    units = split_model.launch_units(
        contexts, hkv, splits, programs, fp8, pa.multiprocessors(device), 80.0, 20.0, 20.0
    )
    return round(units / 1e3, 3)


def _trajectory_row(
    step: int, device: str = "cuda", horizon: int = 2048, heads: tuple[int, int, int] = (16, 8, 128)
) -> dict[str, Any]:
    """Decode attention at one W1 step, its real spread of contexts, each way of splitting:
    the engine's (proportional runs, `split_target_programs`), FP8 at twice the engine's waves of
    its tile (`fp8_2w`), balanced (`*_bal`: every split the same run of tiles; `*_bal{N}` at N waves of
    the tile's programs instead of the engine's `BALANCED_WAVES`), and the step's contexts
    all at their mean (`*_mean`: what a uniform-length timing would say); beside each timing
    the split model's figure for the launch (`*_model`). FP8 as the V2 runner
    launches it, queries taken as rotated (the timing does not depend on their values)."""
    from davit_engine.kernels import paged_attention as pa
    from davit_tools.bench.split_model import engine_settings
    from davit_tools.bench.timing import graph_us

    contexts = w1_decode_step(step)
    hq, hkv, dim = heads
    dev = torch.device(device)
    mean = round(sum(contexts) / len(contexts))
    row: dict[str, Any] = {
        "step": step, "requests": len(contexts), "mean_context": mean,
        "max_context": max(contexts), "heads": f"{hq}/{hkv}x{dim}", "horizon": horizon,
    }  # fmt: skip
    for label, ctxs in (("", contexts), ("_mean", [mean] * len(contexts))):
        q, bf16, fp8, kv_scale, tables, lens, qsl = _paged_batch(ctxs, hq, hkv, device, dim)
        for cache_name, cache, scale in (("bf16", bf16, None), ("fp8", fp8, kv_scale)):
            is_fp8 = scale is not None
            ways: list[tuple[str, int, int | None]] = [
                ("", pa.default_num_splits(len(ctxs), hkv, horizon, dev, fp8=is_fp8), None)
            ]
            if is_fp8:
                with engine_settings(True, waves_times=2.0):
                    ways.append(
                        ("_2w", pa.default_num_splits(len(ctxs), hkv, horizon, dev, fp8=True), None)
                    )
            if not label:  # balanced at the engine's waves, and at the other of 2, 3, 4
                default_waves = pa.BALANCED_WAVES[pa._cache_kind(is_fp8)]
                for count in (default_waves, *(w for w in (2.0, 3.0, 4.0) if w != default_waves)):
                    suffix = "_bal" if count == default_waves else f"_bal{count:g}"
                    ways.append(
                        (suffix, *_balanced_launch(len(ctxs), hkv, horizon, dev, is_fp8, count))
                    )
            for suffix, splits, programs in ways:
                launch = functools.partial(
                    pa.paged_attention, q, cache, tables, lens, qsl, 1, dim**-0.5, splits,
                    kv_scale=scale, queries_rotated=is_fp8, split_programs=programs,
                )  # fmt: skip
                row[f"{cache_name}{suffix}{label}_us"] = round(graph_us(launch, 20), 2)
                row[f"{cache_name}{suffix}{label}_splits"] = splits
                row[f"{cache_name}{suffix}{label}_model"] = _split_model_units(
                    ctxs, hkv, splits, programs, is_fp8, dev
                )
        del bf16, fp8
        torch.cuda.empty_cache()
    row["speedup"] = round(row["bf16_us"] / row["fp8_us"], 3)
    return row


def section_w1_trajectory(args: argparse.Namespace) -> None:
    """Decode attention along W1's run at its real contexts (`_trajectory_row`)."""
    for step in W1_TRAJECTORY_STEPS:
        record("w1-trajectory", **_trajectory_row(step))


# ---- workloads ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    quantization: str | None
    kv_cache_dtype: str
    # engine module switches (module, attribute, value) set while this variant's engine exists
    switches: tuple[tuple[str, str, object], ...] = ()
    lm_head_quantization: str | None = None  # --lm-head-quantization


# The base variants that a switch variant builds on: (name, weight quantization, KV cache dtype).
_BASES = (("bf16", None, "auto"), ("fp8-kv", None, "fp8"), ("fp8-both", "fp8", "fp8"))


def _attention_variants(suffix: str, attribute: str, value: object) -> dict[str, Variant]:
    """bf16, FP8 KV and FP8 weights + KV variants with one paged-attention module switch set."""
    module = "davit_engine.kernels.paged_attention"
    return {
        f"{base}-{suffix}": Variant(
            f"{base}-{suffix}", quantization, kv_dtype, ((module, attribute, value),)
        )  # fmt: skip
        for base, quantization, kv_dtype in _BASES
    }


VARIANTS = {
    "bf16": Variant("bf16", None, "auto"),
    "fp8-kv": Variant("fp8-kv", None, "fp8"),
    "fp8-weights": Variant("fp8-weights", "fp8", "auto"),
    "fp8-both": Variant("fp8-both", "fp8", "fp8"),
    # and the LM head's weight in FP8 (lossy, its own flag)
    "fp8-both-lm-head": Variant("fp8-both-lm-head", "fp8", "fp8", lm_head_quantization="fp8"),
    # or in int8 (per-row scales: about four times FP8's precision at the same bytes), its
    # codes widened with packed instructions, and with the compiler's conversion
    # (fp8_gemv.INT8_WIDEN_PRMT off)
    "fp8-both-lm-head-int8": Variant(
        "fp8-both-lm-head-int8", "fp8", "fp8", lm_head_quantization="int8"
    ),
    "fp8-both-lm-head-int8-cvt": Variant(
        "fp8-both-lm-head-int8-cvt",
        "fp8",
        "fp8",
        (("davit_engine.kernels.fp8_gemv", "INT8_WIDEN_PRMT", False),),
        lm_head_quantization="int8",
    ),
    # SiLU x up as its own kernel after the gate/up product, not in its epilogue
    "fp8-both-separate-silu": Variant(
        "fp8-both-separate-silu",
        "fp8",
        "fp8",
        (("davit_engine.runner.v2.fused_layers", "FUSE_FP8_GATE_ACTIVATION", False),),
    ),  # fmt: skip
    # split decodes aiming at given program counts on 132 multiprocessors (the engine's since
    # run 24, `SPLIT_WAVES`: bf16 1,056, FP8 2,112): 528 for both (the target before run 23),
    # 1,056 (run 23's), 2,112 (four waves of bf16's tile, two of FP8's); decodes
    # just past one full wave of programs split in two (SPLIT_PAST_FULL_WAVE); balanced splits
    # (BALANCE_SPLITS: every split the same run of key tiles)
    **_attention_variants("splits-528", "SPLIT_WAVES", {"model": 1.0, "fp8": 0.5}),
    **_attention_variants("splits-1056", "SPLIT_WAVES", {"model": 2.0, "fp8": 1.0}),
    **_attention_variants("splits-2112", "SPLIT_WAVES", {"model": 4.0, "fp8": 2.0}),
    # the FP8 tile's target just under two waves (2,006 or 1,584 programs on 132
    # multiprocessors): a full W1 batch (256 requests x 8 KV heads, 2,048 programs) unsplit,
    # without the merge, where two waves split it in two
    **_attention_variants("splits-fp8-1.9w", "SPLIT_WAVES", {"model": 2.0, "fp8": 1.9}),
    **_attention_variants("splits-fp8-1.5w", "SPLIT_WAVES", {"model": 2.0, "fp8": 1.5}),
    # and beyond two: three or four waves of the FP8 tile's programs (more loads in flight
    # where a card streams faster than the H100)
    **_attention_variants("splits-fp8-3w", "SPLIT_WAVES", {"model": 2.0, "fp8": 3.0}),
    **_attention_variants("splits-fp8-4w", "SPLIT_WAVES", {"model": 2.0, "fp8": 4.0}),
    **_attention_variants("balanced", "BALANCE_SPLITS", True),
    **_attention_variants("split-past-wave", "SPLIT_PAST_FULL_WAVE", True),
    # the FP8 cache's rotary kernel at 4 warps per program (the default is 8), with the
    # Hadamard tile made in registers (the default reads it from memory), and both
    # (layer_ops.ROTARY_FP8_NUM_WARPS, ROTARY_HADAMARD_FROM_MEMORY)
    **{
        f"fp8-kv-rotary-{suffix}": Variant(
            f"fp8-kv-rotary-{suffix}",
            None,
            "fp8",
            tuple(("davit_engine.kernels.layer_ops", name, value) for name, value in switches),
        )
        for suffix, switches in (
            ("4w", (("ROTARY_FP8_NUM_WARPS", 4),)),
            ("reg", (("ROTARY_HADAMARD_FROM_MEMORY", False),)),
            # the launch before run 24: 4 warps, the tile made in registers
            ("4w-reg", (("ROTARY_FP8_NUM_WARPS", 4), ("ROTARY_HADAMARD_FROM_MEMORY", False))),
        )
    },
    # the one-row FP8 products with W streamed through 3 or 4 pipeline stages, and with the
    # first tile fetched before the wait for the kernel before (fp8_gemv.STREAM_STAGES,
    # STREAM_PRELOAD)
    **{
        v.name: v
        for v in (
            Variant(
                f"fp8-both-stream{stages}{'-preload' if preload else ''}",
                "fp8",
                "fp8",
                (("davit_engine.kernels.fp8_gemv", "STREAM_STAGES", stages),)
                + ((("davit_engine.kernels.fp8_gemv", "STREAM_PRELOAD", 1),) if preload else ()),
            )
            for stages, preload in ((3, 0), (4, 0), (3, 1), (4, 1))
        )
    },
    # the attention and rotary kernels' loads of step metadata, block tables, slots, cos/sin
    # and the Hadamard tile after the wait for the kernel before, as before run 25
    # (paged_attention.LOADS_BEFORE_WAIT, layer_ops.ROTARY_LOADS_BEFORE_WAIT: on by default)
    **{
        f"{base}-late": Variant(
            f"{base}-late",
            quantization,
            kv,
            (
                ("davit_engine.kernels.paged_attention", "LOADS_BEFORE_WAIT", False),
                ("davit_engine.kernels.layer_ops", "ROTARY_LOADS_BEFORE_WAIT", False),
            ),
        )
        for base, quantization, kv in _BASES
    },
    # each decoder layer's o projection, post-attention norm, MLP and the norm after it as one
    # persistent kernel at one token (fused_layers.PERSISTENT_FP8_MLP), at most 8 (its
    # default, capped by occupancy), 2 or 4 programs a multiprocessor (fp8_mlp_block.PROGRAMS_PER_SM)
    **{
        f"fp8-both-mlp-block{suffix}": Variant(
            f"fp8-both-mlp-block{suffix}",
            "fp8",
            "fp8",
            (("davit_engine.runner.v2.fused_layers", "PERSISTENT_FP8_MLP", True),)
            + (
                (("davit_engine.kernels.fp8_mlp_block", "PROGRAMS_PER_SM", per_sm),)
                if per_sm
                else ()
            ),
        )
        for suffix, per_sm in (("", 0), ("-2", 2), ("-4", 4))
    },
    # the rotary kernel in one program a token, queries then keys and values, as before run 27
    # (layer_ops.ROTARY_SPLIT_QK off; `-16w`: at 16 warps); `-split-below-N`: two programs a
    # token only at launches of fewer than N tokens (ROTARY_SPLIT_MAX_TOKENS)
    **{
        f"{base}-rotary-{suffix}": Variant(
            f"{base}-rotary-{suffix}",
            quantization,
            kv,
            tuple(("davit_engine.kernels.layer_ops", name, value) for name, value in switches),
        )
        for base, quantization, kv in _BASES
        for suffix, switches in (
            ("one", (("ROTARY_SPLIT_QK", False),)),
            ("one-16w", (("ROTARY_SPLIT_QK", False), ("ROTARY_FP8_NUM_WARPS", 16))),
            ("split-below-16", (("ROTARY_SPLIT_MAX_TOKENS", 16),)),
            ("split-below-64", (("ROTARY_SPLIT_MAX_TOKENS", 64),)),
        )
    },
    # the FP8 cache's decode in another tile (`fp8-kv-tile-64x4x3`: 64-key tiles, 4 warps, 3
    # stages, registers capped at 128; `-nocap`: uncapped), as the `decode-tiles` section
    # times them
    **_tile_variants(),
    # the rotary kernel where it rotates with one token a program everywhere (`-one-token`),
    # or 2 or 4 tokens a program everywhere, at 8 or 16 warps (the engine's: 2 at prefill
    # launches, one at decode; layer_ops.ROTARY_TOKEN_GROUP, ROTARY_GROUP_NUM_WARPS)
    **{
        f"{base}-rotary-group{suffix}": Variant(
            f"{base}-rotary-group{suffix}",
            quantization,
            kv,
            tuple(("davit_engine.kernels.layer_ops", name, value) for name, value in switches),
        )
        for base, quantization, kv in _BASES[1:]
        for suffix, switches in (
            ("-one-token", (("ROTARY_TOKEN_GROUP", 1),)),
            ("2", (("ROTARY_TOKEN_GROUP", 2),)),
            ("4", (("ROTARY_TOKEN_GROUP", 4),)),
            ("2-16w", (("ROTARY_TOKEN_GROUP", 2), ("ROTARY_GROUP_NUM_WARPS", 16))),
            ("4-16w", (("ROTARY_TOKEN_GROUP", 4), ("ROTARY_GROUP_NUM_WARPS", 16))),
        )
    },
    # at one token, each residual add + RMSNorm as kernels of their own, as before run 28
    # (fused_layers.NORM_IN_ONE_ROW_PRODUCTS, on by default: folded into the FP8 products,
    # 2 x layers - 1 launches fewer a step)
    "fp8-both-norm-kernels": Variant(
        "fp8-both-norm-kernels",
        "fp8",
        "fp8",
        (("davit_engine.runner.v2.fused_layers", "NORM_IN_ONE_ROW_PRODUCTS", False),),
    ),
    # decodes split in many short ranges (W2's) at 8 warps a program instead of 4
    # (paged_attention.SHORT_SPLIT_NUM_WARPS)
    **_attention_variants("split-8w", "SHORT_SPLIT_NUM_WARPS", 8),
    # the one-row products' switches (fp8_gemv): the plain products' first tile of W loaded
    # before the wait for the kernel before (PLAIN_PRELOAD); two K steps' loads a round (the
    # norm chain's products included) at both tiles (UNROLL_NARROW on), or at none
    # (PLAIN_UNROLL 1, as before run 34), where the default takes it at the 8 x 512 tile only
    **{
        name: Variant(name, "fp8", "fp8", (("davit_engine.kernels.fp8_gemv", attribute, value),))
        for name, attribute, value in (
            ("fp8-both-preload", "PLAIN_PRELOAD", 1),
            ("fp8-both-unroll2", "UNROLL_NARROW", True),
            ("fp8-both-unroll1", "PLAIN_UNROLL", 1),
        )
    },
}


def variant_named(name: str) -> Variant:
    """The variant `name`: one of `VARIANTS`, or several joined by "+" (their switches together,
    in order), so that one call can time a combination of switches without a new entry. The
    parts must name one KV cache dtype; a weight or LM head quantization set by one part (None
    sets none) must not differ from another's."""
    parts = name.split("+")
    unknown = [part for part in parts if part not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    if len(parts) == 1:
        return VARIANTS[name]
    chosen = [VARIANTS[part] for part in parts]

    def agreed(field: str, unset: object) -> Any:
        values = {getattr(v, field) for v in chosen} - {unset}
        if len(values) > 1:
            raise ValueError(f"variant {name!r}: its parts disagree on {field} ({sorted(values)})")
        return values.pop() if values else unset

    switches = tuple(sw for v in chosen for sw in v.switches)
    settings = [(module, attribute) for module, attribute, _ in switches]
    if len(set(settings)) != len(settings):
        raise ValueError(f"variant {name!r}: its parts set the same switch twice")
    return Variant(
        name,
        agreed("quantization", None),
        agreed("kv_cache_dtype", object()),
        switches,
        agreed("lm_head_quantization", None),
    )


def w2_floor_bytes(w2: W2, variant: Variant) -> int:
    """Bytes one W2 decode step must read at the floor context: every decoder projection at 1
    byte per weight (plus its float32 channel scales) with FP8 weights, else 2; the LM head at
    1 (plus a float32 scale per row) with an FP8 or int8 head, else 2; norms at 2; K and V at 1 or 2
    bytes per element."""
    c = model_shape(w2.model)
    per_layer_proj = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    per_layer_proj += 3 * c.hidden_size * c.intermediate_size
    proj = c.num_layers * per_layer_proj
    scales = (
        c.num_layers
        * 4
        * (c.q_size + 2 * c.kv_size + c.hidden_size + 2 * c.intermediate_size + c.hidden_size)
    )
    rest = c.num_parameters() - c.vocab_size * c.hidden_size - proj
    weights = proj * (1 if variant.quantization else 2) + (scales if variant.quantization else 0)
    if variant.lm_head_quantization:
        head = c.vocab_size * c.hidden_size
        weights += head + 4 * c.vocab_size
        rest -= head
    kv_element = 1 if variant.kv_cache_dtype != "auto" else 2
    kv = w2.floor_context * c.num_layers * c.num_kv_heads * c.head_dim * 2 * kv_element
    return weights + 2 * rest + kv


def _run_workload(
    workload: OfflineWorkload, variant: Variant, copy_bw: float, profile: bool = False
) -> dict[str, Any]:
    """One run of `workload` on a fresh engine of `variant` (after a warm-up). `profile`: the
    workload's loop under the torch profiler, its kernel figures under "kernels"
    (`kernel_figures`)."""
    from davit_tools.bench.gpu_suite import (
        _engine_loop,
        free_memory,
        make_core,
        warmup_requests,
        workload_requests,
    )

    # set before the engine exists: its decode graphs are captured inside make_core
    with switched(variant.switches):
        start = time.perf_counter()
        core = None
        try:
            core = make_core(workload.model, "v2", False, "bfloat16",
                             quantization=variant.quantization, kv_cache_dtype=variant.kv_cache_dtype,
                             lm_head_quantization=variant.lm_head_quantization,
                             **workload.engine_limits())  # fmt: skip
            setup_s = time.perf_counter() - start
            vocab = core.model_info.vocab_size
            _engine_loop(core, warmup_requests(vocab))
            requests = workload_requests(workload, vocab)
            if profile:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as torch_profile

                torch.cuda.synchronize()
                with torch_profile(
                    activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]
                ) as prof:
                    res = _engine_loop(core, requests)
                    torch.cuda.synchronize()
                res["kernels"] = kernel_figures(_kernel_spans(prof))
                res["launch_groups"] = _trace_launch_groups(prof)
            else:
                res = _engine_loop(core, requests)
            memory = core.memory_profile
            res["num_blocks"] = core.model_info.num_blocks
            if memory is not None:
                res["token_capacity"] = memory.memory.token_capacity
                res["block_bytes"] = memory.memory.block_bytes
                res["weights_gib"] = round(memory.memory.weights_bytes / 2**30, 3)
        finally:
            if core is not None:
                core.shutdown()
                del core
            free_memory()
    res["setup_s"] = round(setup_s, 1)
    return res


def _kernel_spans(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel a torch profiler saw."""
    from torch.autograd import DeviceType

    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]


def kernel_figures(spans: list[tuple[str, float, float]], top: int = 20) -> dict[str, Any]:
    """From kernel intervals (microseconds): the span from the first start to the last end,
    the GPU busy time (the union of the intervals: kernels launched with programmatic
    dependent launch overlap the one before, so their sum counts that overlap twice), the sum,
    and the `top` kernels by total time with their launch counts, in seconds."""
    busy, end, last = 0.0, float("-inf"), ""
    gaps: list[tuple[float, str, str]] = []  # idle stretches: (us, kernel before, kernel after)
    for start, stop, name in sorted((a, b, n) for n, a, b in spans):  # new parts only
        if start > end > float("-inf"):
            gaps.append((start - end, last, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    totals: dict[str, list[float]] = {}
    for name, start, stop in spans:
        entry = totals.setdefault(name[:80], [0.0, 0])
        entry[0] += stop - start
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    span = max(b for _, _, b in spans) - min(a for _, a, _ in spans) if spans else 0.0
    return {
        "span_s": round(span / 1e6, 6),
        "busy_s": round(busy / 1e6, 6),
        "sum_s": round(sum(t for t, _ in totals.values()) / 1e6, 6),
        "top": [[name, round(t / 1e6, 6), int(n)] for name, (t, n) in ranked],
        "idle": idle_figures(gaps),
    }


# Bounds (us) of the idle-gap classes `idle_figures` counts
IDLE_BOUNDS_US = (5.0, 20.0, 100.0, 1000.0)


def idle_figures(gaps: list[tuple[float, str, str]], longest: int = 5) -> dict[str, Any]:
    """Where a run's GPU idle time (span minus busy) is: its gaps between kernels by length
    class (`<5us`, `5-20us`, ... `>=1000us`: count and seconds), and the `longest` gaps with the
    kernels either side (80 characters of each name). Many short gaps point at launches the
    GPU waits on; few long ones at the host (scheduling, a step's inputs, a capture)."""
    bounds = (0.0, *IDLE_BOUNDS_US, float("inf"))
    labels = [f"<{IDLE_BOUNDS_US[0]:g}us"]
    labels += [
        f"{low:g}-{high:g}us" for low, high in zip(IDLE_BOUNDS_US, IDLE_BOUNDS_US[1:], strict=False)
    ]
    labels.append(f">={IDLE_BOUNDS_US[-1]:g}us")
    classes: dict[str, list[float]] = {}
    for label, low, high in zip(labels, bounds[:-1], bounds[1:], strict=True):
        inside = [g for g, _, _ in gaps if low <= g < high]
        classes[label] = [len(inside), round(sum(inside) / 1e6, 6)]
    ranked = sorted(gaps, key=lambda gap: -gap[0])[:longest]
    return {
        "classes": classes,
        "longest": [[round(g, 1), before[:80], after[:80]] for g, before, after in ranked],
    }


# Kernels whose launches the profile groups by launch shape (`launch_groups`)
GROUPED_KERNELS = ("_paged_attention_kernel", "_qk_norm_rope_kernel", "_merge_splits_kernel")


def launch_groups(
    trace: dict[str, Any], names: tuple[str, ...] = GROUPED_KERNELS, top: int = 40
) -> dict[str, list[list[Any]]]:
    """Per kernel of `names`, its launches grouped by launch shape from a chrome trace (the
    torch profiler's: kernel events carry grid, block, registers per thread and shared
    memory): [grid, block, registers, shared bytes, total seconds, launches], the `top` groups
    by total time. The decode attention's grid is (requests x query tiles, KV heads, splits),
    so its groups show where a run's attention time goes by batch size and split count."""
    groups: dict[str, dict[tuple[Any, ...], list[float]]] = {name: {} for name in names}
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel" or "dur" not in event:
            continue
        name = next((n for n in names if n in str(event.get("name", ""))), None)
        if name is None:
            continue
        args = event.get("args", {})
        key = (
            tuple(args.get("grid", ())),
            tuple(args.get("block", ())),
            args.get("registers per thread"),
            args.get("shared memory"),
        )
        entry = groups[name].setdefault(key, [0.0, 0])
        entry[0] += float(event["dur"])
        entry[1] += 1
    return {
        name: [
            [list(grid), list(block), regs, smem, round(total / 1e6, 6), int(count)]
            for (grid, block, regs, smem), (total, count) in sorted(
                found.items(), key=lambda item: -item[1][0]
            )[:top]
        ]
        for name, found in groups.items()
    }


def _trace_launch_groups(prof: Any) -> dict[str, list[list[Any]]]:
    """`launch_groups` of a finished torch profiler run (its chrome trace through a
    temporary file)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        with path.open() as f:
            return launch_groups(json.load(f))


def rounds_summary(figures: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Per variant (in the order given): its runs' median, minimum and maximum, and its median
    over the first variant's. Between calls of one machine W1 moved by +-3% and within a call
    by up to 8% (bench notes, run 22), so a ratio of single runs carries that much."""
    names = list(figures)
    base = statistics.median(figures[names[0]])
    rows = []
    for name in names:
        runs = figures[name]
        median = statistics.median(runs)
        rows.append({
            "variant": name,
            "runs": len(runs),
            "median": round(median, 1),
            "min": round(min(runs), 1),
            "max": round(max(runs), 1),
            "median_over_first": round(median / base, 3),
        })  # fmt: skip
    return rows


def section_w2(args: argparse.Namespace) -> None:
    w2 = W2()
    first: list[list[int]] | None = None
    names = args.w2_variants.split(",")
    figures: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(1, args.rounds + 1):  # variants interleaved, so drift hits each alike
        for name in names:
            variant = variant_named(name)
            res = _run_workload(w2, variant, args.copy_bw)
            outputs = list(res.pop("outputs").values())
            decode = w2.decode_tokens / (res["elapsed_s"] - res["first_token_s"])
            floor = args.copy_bw / w2_floor_bytes(w2, variant)
            same = None
            if first is None:
                first = outputs
            else:
                same = sum(a == b for a, b in zip(first[0], outputs[0], strict=False))
            figures[name].append(decode)
            record("w2", variant=name, round=round_, model=w2.model, decode_tok_s=round(decode, 1),
                   floor_tok_s=round(floor, 1), share_of_floor=round(decode / floor, 3),
                   tokens_equal_to_first_variant=same, runner="v2-graphs-async", **res,
                   **versions())  # fmt: skip
    if args.rounds > 1:
        for row in rounds_summary(figures):
            record("w2-rounds", figure="decode_tok_s", **row)


def _w1_variant_rounds(
    args: argparse.Namespace, workload: OfflineWorkload, section: str, figure: str,
    derive: Callable[[dict[str, Any]], None] | None = None, **fields: Any,
) -> None:  # fmt: skip
    """`workload` on each of `--w1-variants`, `--rounds` times interleaved: a `section` row per
    run (`derive` adds computed fields to the run's result first), then with rounds each
    variant's median, minimum and maximum of `figure` (`{section}-rounds`)."""
    names = args.w1_variants.split(",")
    figures: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(1, args.rounds + 1):
        for name in names:
            res = _run_workload(workload, variant_named(name), args.copy_bw)
            res.pop("outputs")
            if derive is not None:
                derive(res)
            figures[name].append(res[figure])
            record(section, variant=name, round=round_, **fields, **res, **versions())
    if args.rounds > 1:
        for row in rounds_summary(figures):
            record(f"{section}-rounds", figure=figure, **row)


def section_w1(args: argparse.Namespace) -> None:
    w1 = W1()
    _w1_variant_rounds(args, w1, "w1", "output_tok_s", model=w1.model, runner="v2-graphs-async")


def section_w1_prefill(args: argparse.Namespace) -> None:
    """W1's prompts alone (each request one output token): the prefill part of W1, where an
    FP8 cache's chunks attend to FP8 keys through the prefill tiles."""
    prompt_tokens = sum(W1().lengths()[0])

    def derive(res: dict[str, Any]) -> None:
        res["prefill_tok_s"] = round(prompt_tokens / res["elapsed_s"], 1)

    prompts_alone = dataclasses.replace(W1(), output_len=(1, 1))
    _w1_variant_rounds(args, prompts_alone, "w1-prefill", "prefill_tok_s", derive,
                       prompt_tokens=prompt_tokens)  # fmt: skip


def section_w1_profile(args: argparse.Namespace) -> None:
    """One W1 run per variant under the torch profiler: wall time, GPU busy time and the
    largest kernels' totals (the profiler slows the host, so wall minus busy overstates the
    idle time of an unprofiled run)."""
    for name in args.w1_variants.split(","):
        res = _run_workload(W1(), variant_named(name), args.copy_bw, profile=True)
        res.pop("outputs")
        record("w1-profile", variant=name, **res, **versions())


def section_w2_profile(args: argparse.Namespace) -> None:
    """One W2 run per `--w2-variants` entry under the torch profiler: where a decode step's
    time goes, kernel by kernel (graph replays included)."""
    for name in args.w2_variants.split(","):
        res = _run_workload(W2(), variant_named(name), args.copy_bw, profile=True)
        res.pop("outputs")
        record("w2-profile", variant=name, **res, **versions())


def section_memory(args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "davit_tools.bench.memory_check", "--shapes", args.memory_shapes,
           "--kv-cache-dtype", "fp8", "--max-num-batched-tokens", str(args.memory_batched_tokens),
           "--seconds-per-shape", str(args.memory_seconds)]  # fmt: skip
    env = {**os.environ, "OUT": str(OUT / "memory")}
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=args.memory_timeout_s
    )
    (OUT / "memory.log").write_text(done.stdout[-200_000:] + done.stderr[-200_000:])
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"shape"')]
    record("memory", returncode=done.returncode, rows=lines, command=" ".join(cmd[1:]))


def section_quality(args: argparse.Namespace) -> None:
    from davit_engine.config import EngineConfig
    from davit_engine.kernels.attention_backend import TritonPagedAttention
    from davit_engine.tokenizer import load_tokenizer
    from davit_tools.bench.fp8_quality import CONFIGS, agreement, measure

    if args.smollm2_gguf is None:
        raise ValueError("--smollm2-gguf: the quality section needs the SmolLM2 GGUF")
    base = EngineConfig(
        model=str(args.smollm2_gguf), device="cuda", dtype="bfloat16", max_model_len=512,
        max_num_seqs=32, max_num_batched_tokens=512,
    )  # fmt: skip
    ids = load_tokenizer(base).encode(Path(args.quality_text).read_text())
    reference: dict[str, Any] = {}
    for quality in CONFIGS:
        figures = measure(base, quality, ids, torch.device("cuda"), TritonPagedAttention())
        row: dict[str, Any] = {"config": quality.name, "tokens": len(ids),
                               "perplexity": round(figures["perplexity"], 3)}  # fmt: skip
        if not reference:
            reference = figures
        else:
            row["change_pct"] = round(
                100 * (figures["perplexity"] / reference["perplexity"] - 1), 2
            )
            row.update(agreement(reference["completions"], figures["completions"]).as_dict())
        record("quality", **row, **versions())


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "tests": section_tests,
    "gemm": section_gemm,
    "attention": section_attention,
    "w2": section_w2,
    "w1": section_w1,
    "w1-prefill": section_w1_prefill,
    "w1-profile": section_w1_profile,
    "w1-trajectory": section_w1_trajectory,
    "decode-tiles": section_decode_tiles,
    "rotary": section_rotary,
    "w2-profile": section_w2_profile,
    "mlp-block": section_mlp_block,
    "memory": section_memory,
    "quality": section_quality,
}


_BRIEF = {
    "gemm": ("shape", "rows", "bf16_us", "default_us", "default_tb_s", "best", "best_us",
             "scaled_mm_us"),
    "attention": ("shape", "batch", "context", "splits", "bf16_us", "fp8_us", "fp8_tb_s",
                  "speedup", "fp8_q_tile_us", "fp8_uncapped_us"),
    "w2": ("variant", "round", "decode_tok_s", "floor_tok_s", "share_of_floor",
           "tokens_equal_to_first_variant", "num_blocks"),
    "w1": ("variant", "round", "output_tok_s", "elapsed_s", "token_capacity"),
    "w1-rounds": ("variant", "runs", "median", "min", "max", "median_over_first"),
    "w1-prefill": ("variant", "round", "prefill_tok_s", "elapsed_s"),
    "w1-prefill-rounds": ("variant", "runs", "median", "min", "max", "median_over_first"),
    "w1-profile": ("variant", "output_tok_s", "elapsed_s", "kernels"),
    "w2-profile": ("variant", "elapsed_s", "kernels"),
    "w1-trajectory": ("step", "requests", "mean_context", "max_context", "bf16_us", "fp8_us",
                      "fp8_2w_us", "bf16_bal_us", "fp8_bal_us", "fp8_bal2_us", "fp8_bal4_us",
                      "bf16_mean_us", "fp8_mean_us",
                      "fp8_splits", "fp8_2w_splits", "fp8_bal_splits", "speedup"),
    "w2-rounds": ("variant", "runs", "median", "min", "max", "median_over_first"),
}  # fmt: skip


def _table() -> str:
    lines = []
    for row in ROWS:
        if row["section"] in _BRIEF:
            brief = ", ".join(f"{k}={row.get(k)}" for k in _BRIEF[row["section"]])
            lines.append(f"{row['section']}: {brief}")
            continue
        keys = [k for k in row if k not in ("section", "gpu", "torch", "triton", "rows")]
        brief = ", ".join(f"{k}={row[k]}" for k in keys[:14])
        lines.append(f"{row['section']}: {brief}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m davit_tools.bench.fp8")
    parser.add_argument("--sections", default="tests,gemm,attention,w2,w1,memory")
    parser.add_argument("--w2-variants", default="bf16,fp8-both")
    parser.add_argument("--w1-variants", default="bf16,fp8-kv")
    parser.add_argument("--rounds", type=int, default=1,
                        help="W1/W2: run the variants this many times, interleaved, and record "
                        "each one's median, minimum and maximum")  # fmt: skip
    parser.add_argument("--gemm-configs", default="32/512/4/4",
                        help="extra matrix-unit tiles: BLOCK_N/BLOCK_K/WARPS/STAGES;...")  # fmt: skip
    parser.add_argument("--tile-configs", default=DECODE_TILE_CONFIGS,
                        help="decode-tiles: FP8 decode tiles BLOCK_N/WARPS/STAGES/REGISTER_CAP;... "
                             "(cap 0: none; the first is the engine's)")  # fmt: skip
    parser.add_argument("--rotary-configs", default=ROTARY_GROUP_CONFIGS,
                        help="rotary: token groups GROUP/WARPS;... (group 0: chosen per launch; "
                             "the first is the reference)")  # fmt: skip
    parser.add_argument("--gemv-configs",
                        default="8/512/4/0;4/1024/4/0;16/512/4/0;8/1024/4/0;16/1024/8/0;"
                                "8/512/4/1",
                        help="matrix-vector tiles: BLOCK_N/BLOCK_K/WARPS/SPLIT_K;... (0: "
                             "auto)")  # fmt: skip
    parser.add_argument("--gemm-rows", default="1,2,4,8,16,256")
    parser.add_argument("--copy-bw", type=float, default=4.24e12, help="bytes/s (run 2)")
    parser.add_argument("--memory-shapes", default="qwen3-0.6b:16384")
    parser.add_argument("--memory-batched-tokens", type=int, default=8192)
    parser.add_argument("--memory-seconds", type=float, default=60)
    parser.add_argument("--memory-timeout-s", type=float, default=200)
    parser.add_argument("--tests-timeout-s", type=float, default=240)
    parser.add_argument(
        "--tests-args",
        default="",
        help="extra pytest arguments, split as a shell would: -m gpu -k 'gemv or cuda_paths'",
    )
    parser.add_argument("--deadline-s", type=float, default=560, help="skip sections after this")
    parser.add_argument("--smollm2-gguf", type=Path, default=None)
    parser.add_argument("--quality-text", default="tests/data/text/tom-sawyer-chapter-1.txt")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    for flag, given in (("--w1-variants", args.w1_variants), ("--w2-variants", args.w2_variants)):
        for name in given.split(","):
            try:
                variant_named(name)
            except ValueError as exc:
                parser.error(f"{flag}: {exc}")
    unknown = [name for name in args.sections.split(",") if name not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown section(s) {unknown}; choose from {sorted(SECTIONS)}")
    try:
        _parse_configs(args.gemm_configs)
        _parse_gemv_configs(args.gemv_configs)
    except ValueError as exc:
        parser.error(str(exc))
    OUT.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for name in args.sections.split(","):
        if time.perf_counter() - start > args.deadline_s:
            record("skipped", name=name, reason="deadline")
            continue
        began = time.perf_counter()
        try:
            SECTIONS[name](args)
        except Exception as exc:  # report and run the next section
            traceback.print_exc()
            record("error", name=name, error=f"{type(exc).__name__}: {exc}"[:400])
        print(f"[{name}] {time.perf_counter() - began:.1f} s", flush=True)
    print(_table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
