"""Check the memory profile against what a real run uses, on a GPU, in one process.

For each model shape: start an engine core (runner V2, CUDA graphs) that profiles memory and
sizes its KV cache; then run a workload that fills the KV cache at the largest captured decode
batch (`max_num_seqs` requests whose prompt plus output take every block, sampled with top-k and
top-p); then compare each predicted component with its measurement during the run:

- weights: torch's reserved memory before the KV cache exists;
- KV cache and runner buffers: reserved memory added by `initialize_kv_cache` before the
  graph capture (the logits buffer the decode graphs share is one of the buffers);
- CUDA graphs: reserved memory the run's own capture keeps (after releasing warm-up blocks);
- activations + sampler: `max_memory_reserved` during the workload above the steady state,
  against the profile's larger figure of the dummy forward and the probe steps (each row
  carries what the probe steps ran and measured);
- outside torch: device used - torch reserved, at the end.

Measured peak = `torch.cuda.max_memory_reserved()` + outside-torch; it must stay within
`total x gpu_memory_utilization`. Also reported: what sizing the KV cache without the graph
pool would have over-committed, and the explicit `--kv-cache-memory-bytes` path (the profile's
bytes start an identical engine; a size beyond the device is refused).

Results: one JSON line per shape in `$OUT/memory_check.jsonl`, each profile in
`$OUT/profile-<shape>.json`, a table printed last. Imports no HTTP stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from davit_contract.profile import MemoryProfile
from davit_engine.config import EngineConfig
from davit_engine.engine_core import EngineCore
from davit_engine.types import EngineRequest, ParamError, SamplingParams

OUT = Path(os.environ.get("OUT", "/tmp/davit-memory-check"))
_GIB = 2**30


class _Probe:
    """Reserved-memory readings around the run's own KV allocation and graph capture."""

    def __init__(self) -> None:
        self.before_kv = 0
        self.before_capture = 0
        self.after_capture = 0

    def install(self) -> None:
        from davit_engine.runner.v2 import graphs as graphs_module
        from davit_engine.runner.v2.runner import RunnerV2

        probe = self
        original_init = RunnerV2.initialize_kv_cache
        original_capture = graphs_module.DecodeGraphs.capture

        def initialize_kv_cache(runner: RunnerV2, num_blocks: int) -> None:
            torch.cuda.synchronize()
            probe.before_kv = torch.cuda.memory_reserved()
            original_init(runner, num_blocks)

        def capture(graphs: Any) -> None:
            torch.cuda.synchronize()
            probe.before_capture = torch.cuda.memory_reserved()
            original_capture(graphs)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            probe.after_capture = torch.cuda.memory_reserved()

        setattr(RunnerV2, "initialize_kv_cache", initialize_kv_cache)  # noqa: B010
        setattr(graphs_module.DecodeGraphs, "capture", capture)  # noqa: B010


_PROBE = _Probe()


def _config(args: argparse.Namespace, model: str, max_model_len: int, **kw: Any) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype="bfloat16",
        runner="v2",
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        seed=0,
        kv_cache_dtype=args.kv_cache_dtype,
        **kw,
    )


def plan_lengths(
    num_seqs: int, tokens_each: int, budget: int, tail: int
) -> tuple[list[int], list[int]]:
    """Prompt and output lengths with which every request ends at the same step.

    Chunked prefill admits the requests one after another (decodes take one token of the step
    budget each): a request admitted earlier gets a longer output and a shorter prompt, so at
    the last `tail` steps all `num_seqs` requests run as one decode batch and together hold
    `num_seqs x tokens_each` tokens. A few passes of a model of the scheduler settle the plan.
    """
    outputs = [tail] * num_seqs
    prompts = [tokens_each - tail] * num_seqs
    for _ in range(5):
        prompts = [max(1, tokens_each - o) for o in outputs]
        admitted = [0] * num_seqs
        step = running = i = 0
        remaining = prompts[0]
        while i < num_seqs:
            left = max(1, budget - running)
            while left > 0 and i < num_seqs:
                take = min(left, remaining)
                remaining -= take
                left -= take
                if remaining == 0:
                    admitted[i] = step
                    running += 1
                    i += 1
                    remaining = prompts[i] if i < num_seqs else 0
            step += 1
        end = admitted[-1] + tail
        outputs = [min(tokens_each - 1, max(tail, end - a)) for a in admitted]
    return prompts, outputs


def _fill_workload(core: EngineCore, tail: int, deadline: float) -> dict[str, Any]:
    """max_num_seqs requests that together take (almost) every KV block at their last token."""
    config = core.config
    num_seqs = config.max_num_seqs
    # The scheduler keeps 1% of the blocks back while others run, and one block each spare.
    usable = core.model_info.num_blocks - -(-core.model_info.num_blocks // 100)
    blocks_each = usable // num_seqs - 1
    tokens_each = min(blocks_each * config.block_size, core.model_info.max_model_len)
    prompts, outputs = plan_lengths(num_seqs, tokens_each, config.max_num_batched_tokens, tail)
    gen = torch.Generator().manual_seed(0)
    vocab = core.model_info.vocab_size
    for i in range(num_seqs):
        params = SamplingParams(
            max_tokens=outputs[i],
            temperature=1.0,
            top_k=50,
            top_p=0.9,
            ignore_eos=True,
            seed=None,
        )
        prompt = torch.randint(0, vocab, (prompts[i],), generator=gen).tolist()
        core.add_request(EngineRequest(f"fill-{i}", prompt, params))
    max_running = max_used_blocks = steps = 0
    runner = core.runner
    graph_steps_before = getattr(runner, "num_graph_steps", 0)
    started = time.perf_counter()
    rises: list[dict[str, Any]] = []  # the steps where the reserved peak grew, and by how much
    last_peak = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0
    while core.has_unfinished_requests():
        core.step()
        stats = core.stats()
        if torch.cuda.is_available() and torch.cuda.max_memory_reserved() > last_peak:
            peak = torch.cuda.max_memory_reserved()
            rises.append(
                {
                    "step": steps,
                    "rise_mib": round((peak - last_peak) / 2**20, 1),
                    "running": stats.num_running,
                    "waiting": stats.num_waiting,
                    "graph_steps": getattr(runner, "num_graph_steps", 0),
                    "eager_steps": getattr(runner, "num_eager_steps", 0),
                }
            )
            last_peak = peak
        max_running = max(max_running, stats.num_running)
        used = stats.num_total_blocks - stats.num_free_blocks
        max_used_blocks = max(max_used_blocks, used)
        steps += 1
        if time.perf_counter() > deadline:
            core.abort_requests([f"fill-{i}" for i in range(num_seqs)])
            core.step()
            break
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {
        "requests": num_seqs,
        "tokens_each": tokens_each,
        "prompt_len_range": [min(prompts), max(prompts)],
        "output_len_range": [min(outputs), max(outputs)],
        "steps": steps,
        "graph_steps": getattr(runner, "num_graph_steps", 0) - graph_steps_before,
        "max_running": max_running,
        "max_used_blocks": max_used_blocks,
        "kv_fill": round(max_used_blocks / core.model_info.num_blocks, 4),
        "preemptions": core.stats().num_preemptions,
        "seconds": round(time.perf_counter() - started, 1),
        "reserved_peak_rises": rises[-12:],
        "num_reserved_peak_rises": len(rises),
    }


def check_shape(args: argparse.Namespace, shape: str, max_model_len: int) -> dict[str, Any]:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    probe = _PROBE
    model = f"random:{shape}"
    core = EngineCore(_config(args, model, max_model_len))
    runner = core.runner
    profile = core.memory_profile
    assert profile is not None
    predicted = profile.memory
    (OUT / f"profile-{shape}.json").write_text(profile.to_json() + "\n")
    # Steady state: weights + KV + buffers + graph pool, caches released.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    steady = torch.cuda.memory_reserved()
    steady_allocated = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    deadline = time.perf_counter() + args.seconds_per_shape
    workload = _fill_workload(core, args.tail, deadline)
    peak_reserved = torch.cuda.max_memory_reserved()
    # Live tensors at the peak against what the allocator held: the difference is blocks
    # cached in segments of sizes the next request could not use (fragmentation).
    allocator = {
        "allocated_peak_above_steady_bytes": torch.cuda.max_memory_allocated() - steady_allocated,
        "reserved_peak_above_steady_bytes": peak_reserved - steady,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "segments": torch.cuda.memory_stats().get("segment.all.current", 0),
    }
    free, total = torch.cuda.mem_get_info()
    non_torch = (total - free) - torch.cuda.memory_reserved()
    kv_bytes = predicted.num_blocks * predicted.block_bytes
    measured = {
        "weights_bytes": probe.before_kv,
        "kv_cache_bytes": kv_bytes,
        "runner_buffer_bytes": probe.before_capture - probe.before_kv - kv_bytes,
        "cuda_graph_bytes": probe.after_capture - probe.before_capture,
        "activation_peak_bytes": peak_reserved - steady,
        "non_torch_bytes": non_torch,
    }
    measured_peak = peak_reserved + non_torch
    budget = predicted.budget_bytes
    graph_pool = measured["cuda_graph_bytes"]
    graphs = getattr(runner, "graphs", None)
    step_probe = getattr(runner, "step_probe", None)
    row: dict[str, Any] = {
        "shape": shape,
        "dtype": "bfloat16",
        "runner": "v2-graphs",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "total_bytes": int(total),
        "budget_bytes": budget,
        "num_blocks": predicted.num_blocks,
        "token_capacity": predicted.token_capacity,
        "graph_sizes": len(predicted.cuda_graph_sizes),
        # Every decode graph writes one shared float32 buffer (a runner buffer, not the pool).
        "graph_logits": "shared",
        "graph_logits_buffer_bytes": graphs.logits_bytes if graphs is not None else 0,
        "step_probe": dataclasses.asdict(step_probe) if step_probe is not None else None,
        "predicted": {k: getattr(predicted, k) for k in measured},
        "measured": measured,
        "predicted_peak_bytes": predicted.predicted_peak_bytes,
        "measured_peak_bytes": measured_peak,
        "within_budget": measured_peak <= budget,
        "no_graph_estimate_overcommit_bytes": graph_pool,
        "no_graph_estimate_peak_bytes": measured_peak + graph_pool,
        "workload": workload,
        "allocator": allocator,
    }
    core.shutdown()
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _explicit_check(
    args: argparse.Namespace, model: str, max_model_len: int, profile: MemoryProfile
) -> dict[str, Any]:
    """The replica path: the profile's KV bytes give the same blocks; too many are refused."""
    gc.collect()
    torch.cuda.empty_cache()
    kv = profile.memory.kv_cache_bytes
    core = EngineCore(_config(args, model, max_model_len, kv_cache_memory_bytes=kv))
    same = core.model_info.num_blocks == profile.memory.num_blocks
    core.shutdown()
    del core
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    try:
        EngineCore(_config(args, model, max_model_len, kv_cache_memory_bytes=int(total)))
        refused = ""
    except ParamError as exc:
        refused = f"{exc.param}: {exc.message}"
    gc.collect()
    torch.cuda.empty_cache()
    return {"same_blocks_from_profile_bytes": same, "oversized_refused": refused}


def _table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        lines.append(
            f"== {row['shape']} bf16 V2+graphs, max_model_len {row['max_model_len']}, "
            f"max_num_seqs {row['max_num_seqs']}, batched tokens "
            f"{row['max_num_batched_tokens']}, util {row['gpu_memory_utilization']}, "
            f"{row['gpu']}"
        )
        lines.append(f"{'component':<24}{'predicted GiB':>14}{'measured GiB':>14}")
        for key, value in row["predicted"].items():
            lines.append(f"{key:<24}{value / _GIB:>14.3f}{row['measured'][key] / _GIB:>14.3f}")
        lines.append(
            f"{'peak (reserved+other)':<24}{row['predicted_peak_bytes'] / _GIB:>14.3f}"
            f"{row['measured_peak_bytes'] / _GIB:>14.3f}"
        )
        w = row["workload"]
        lines.append(
            f"budget {row['budget_bytes'] / _GIB:.3f} GiB; within budget: {row['within_budget']}; "
            f"KV fill {w['kv_fill']:.1%} ({w['max_running']} running, {w['graph_steps']} graph "
            f"steps, {w['seconds']} s); ignoring graphs would over-commit "
            f"{row['no_graph_estimate_overcommit_bytes'] / _GIB:.3f} GiB "
            f"(peak {row['no_graph_estimate_peak_bytes'] / _GIB:.3f} GiB)"
        )
        probe = row.get("step_probe")
        if probe:
            lines.append(
                f"probe steps: {probe['peak_bytes'] / _GIB:.3f} GiB over steps of "
                f"{list(probe['tokens_per_step'])} tokens sampling "
                f"{list(probe['sampled_per_step'])} rows; shared graph logits "
                f"{row['graph_logits_buffer_bytes'] / _GIB:.3f} GiB (runner buffer)"
            )
        if "explicit" in row:
            lines.append(f"explicit KV bytes: {row['explicit']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m davit_tools.bench.memory_check")
    parser.add_argument(
        "--shapes",
        default="qwen3-0.6b:8192,llama-3.1-8b:8192",
        help="comma-separated SHAPE:MAX_MODEL_LEN",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--tail", type=int, default=16, help="decode steps all requests run together at the end"
    )
    parser.add_argument("--seconds-per-shape", type=float, default=120.0)
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="engine flag of the run"
    )
    parser.add_argument(
        "--explicit-check", default="", help="shapes that also start from explicit KV bytes"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    _PROBE.install()
    rows = []
    for item in args.shapes.split(","):
        shape, _, length = item.partition(":")
        try:
            row = check_shape(args, shape, int(length))
        except (RuntimeError, ParamError) as exc:  # report and go on with the next shape
            traceback.print_exc()
            print(f"{shape}: {type(exc).__name__}: {exc}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        with open(OUT / "memory_check.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        print(_table(rows), flush=True)
    # The replica path last: it matters less than the measurements above if time runs out.
    for row in rows:
        if row["shape"] in args.explicit_check.split(","):
            text = (OUT / f"profile-{row['shape']}.json").read_text()
            model = f"random:{row['shape']}"
            row["explicit"] = _explicit_check(
                args, model, row["max_model_len"], MemoryProfile.from_json(text)
            )
            with open(OUT / "memory_check.jsonl", "a") as f:
                f.write(json.dumps({"shape": row["shape"], "explicit": row["explicit"]}) + "\n")
    print(_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
