"""Offline throughput: N random prompts through `EngineCore`, EOS ignored by default.

Prompts are random token ids from a seeded generator, so runs are comparable across engines
and commits. Prints the configuration beside requests/s and output tokens/s, and optionally
writes both as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from typing import Any

from davit_engine.types import ParamError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="davit bench throughput", description=__doc__)
    parser.add_argument("--model", required=True, help="HF directory, .gguf file or random:<shape>")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw each request's input and output length uniformly from "
        "[len * (1 - r), len * (1 + r)] (0: fixed lengths)",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--runner", default="auto", choices=["auto", "v1", "v2"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None, dest="num_gpu_blocks")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule step N+1 while the device runs step N (runner V2; V1 stays synchronous)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep generating past EOS so every request makes --output-len tokens (default on)",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--output-json", default=None)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ParamError(f"--{name.replace('_', '-')}", "must be at least 1")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ParamError("--random-range-ratio", "must be in [0, 1)")


def _lengths(generator: Any, count: int, length: int, ratio: float) -> list[int]:
    import torch

    low = max(1, int(length * (1 - ratio)))
    high = max(low, int(length * (1 + ratio)))
    return torch.randint(low, high + 1, (count,), generator=generator).tolist()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from davit_engine.config import EngineConfig
    from davit_engine.engine_core import EngineCore
    from davit_engine.types import EngineRequest, SamplingParams

    _check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    ratio = args.random_range_ratio
    max_model_len = args.max_model_len or int((args.input_len + args.output_len) * (1 + ratio)) + 1
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        runner=args.runner,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    load_start = time.perf_counter()
    core = EngineCore(config)
    load_seconds = time.perf_counter() - load_start
    info = core.model_info
    generator = torch.Generator().manual_seed(args.seed)
    input_lens = _lengths(generator, args.num_prompts, args.input_len, ratio)
    output_lens = _lengths(generator, args.num_prompts, args.output_len, ratio)
    prompts = [
        torch.randint(0, info.vocab_size, (n,), generator=generator).tolist() for n in input_lens
    ]
    num_prompt_tokens = sum(input_lens)
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(zip(prompts, output_lens, strict=True)):
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos
        )
        core.add_request(EngineRequest(f"bench-{i}", prompt, sampling))
    num_output = 0
    num_steps = 0
    while core.has_unfinished_requests():
        for delta in core.step():
            num_output += len(delta.new_token_ids)
        num_steps += 1
    elapsed = time.perf_counter() - start
    stats = core.stats()
    core.shutdown()
    return {
        "configuration": {
            "model": args.model,
            "architecture": info.architecture,
            "num_parameters": info.num_parameters,
            "dtype": info.dtype,
            "device": info.device,
            "device_name": _device_name(info.device),
            "runner": info.runner,
            "runner_reason": info.runner_reason,
            "cuda_graphs": info.runner == "v2" and not args.enforce_eager,
            "async_scheduling": info.async_scheduling,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "random_range_ratio": ratio,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "num_blocks": info.num_blocks,
            "block_size": info.block_size,
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "versions": _versions(),
        },
        "results": {
            "elapsed_s": elapsed,
            "load_s": load_seconds,
            "num_steps": num_steps,
            "output_tokens": num_output,
            "prompt_tokens": num_prompt_tokens,
            "total_tokens": num_output + num_prompt_tokens,
            "requests_per_s": args.num_prompts / elapsed,
            "output_tokens_per_s": num_output / elapsed,
            "total_tokens_per_s": (num_output + num_prompt_tokens) / elapsed,
            "num_preemptions": stats.num_preemptions,
        },
        "stats": asdict(stats),
    }


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(torch.device(device)))
    return platform.processor() or platform.machine()


def _versions() -> dict[str, str]:
    import torch

    import davit_engine

    versions = {
        "davit": davit_engine.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.version.cuda:
        versions["cuda"] = str(torch.version.cuda)
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return versions


def throughput_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    # CPU runs share cores with other processes; OpenMP's default spin-waiting then makes
    # multi-threaded ops up to tens of times slower. Must be set before torch loads OpenMP.
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        result = run(args)
    except ParamError as exc:
        print(f"davit bench throughput: {exc.param}: {exc.message}", file=sys.stderr)
        return 2
    c, r = result["configuration"], result["results"]
    print(
        f"model {c['model']} ({c['architecture']}, {c['num_parameters'] / 1e6:.1f}M params), "
        f"dtype {c['dtype']}, device {c['device']} ({c['device_name']}, "
        f"{c['torch_threads']} threads, OMP_WAIT_POLICY {c['omp_wait_policy']}), runner {c['runner']} ({c['runner_reason']}), "
        f"cuda graphs {'on' if c['cuda_graphs'] else 'off'}, "
        f"async scheduling {'on' if c['async_scheduling'] else 'off'}"
    )
    print(
        f"workload: {c['num_prompts']} prompts x {c['input_len']} random tokens -> "
        f"{c['output_len']} output tokens (length range ratio {c['random_range_ratio']}), "
        f"temperature={c['temperature']}, ignore_eos={c['ignore_eos']}, "
        f"max_num_seqs={c['max_num_seqs']}, max_num_batched_tokens={c['max_num_batched_tokens']}"
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in c["versions"].items()))
    print(
        f"Throughput: {r['requests_per_s']:.2f} requests/s, "
        f"{r['output_tokens_per_s']:.1f} output tokens/s, "
        f"{r['total_tokens_per_s']:.1f} total tokens/s "
        f"({r['output_tokens']} output tokens in {r['elapsed_s']:.1f} s, {r['num_steps']} steps, "
        f"{r['num_preemptions']} preemptions; load {r['load_s']:.1f} s)"
    )
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0
