"""Micro-benchmark of the CPU side of a step: `schedule()` + `update_from_output()`.

Run: `python -m davit_tools.bench.scheduler [--num-requests 256 ...]`. The "runner" here
returns a fixed token without touching any KV, so the figure is the scheduler's own cost per
step, which the GPU step must hide (or, with asynchronous scheduling, overlap).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput
from davit_engine.core.scheduler import Scheduler
from davit_engine.types import EngineRequest, SamplingParams


def _fill(scheduler: Scheduler, num_requests: int, prompt_len: int, max_tokens: int) -> None:
    for i in range(num_requests):
        # Distinct prompts: the benchmark measures scheduling, not prefix-cache hits.
        prompt = [(i * 7919 + j) % 50_000 + 10 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(EngineRequest(f"req-{i}", prompt, params, eos_token_ids=(2,)))


def _step(scheduler: Scheduler) -> tuple[float, float, int]:
    """One step; returns (schedule seconds, update seconds, batched tokens)."""
    t0 = time.perf_counter()
    out = scheduler.schedule()
    t1 = time.perf_counter()
    res = RunnerOutput([7 if s.needs_sample else None for s in out.scheduled])
    t2 = time.perf_counter()
    scheduler.update_from_output(out, res)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, out.num_batched_tokens


def run(
    num_requests: int, prompt_len: int, num_steps: int, block_size: int, prefix_caching: bool
) -> dict[str, float]:
    budget = max(8192, num_requests)
    # Early requests decode while later ones prefill: nobody may finish before timing ends.
    max_tokens = num_steps + num_requests * prompt_len // budget + 10
    max_model_len = prompt_len + max_tokens
    blocks_per_request = -(-max_model_len // block_size)
    config = EngineConfig(
        model="bench",
        block_size=block_size,
        max_num_seqs=num_requests,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching,
    )
    scheduler = Scheduler(config, num_requests * blocks_per_request + 1, max_model_len)
    _fill(scheduler, num_requests, prompt_len, max_tokens)

    # Prefill steps (admission, block allocation, hashing of full blocks) until a step is
    # all decodes; that step also warms up the decode path before timing it.
    prefill_s = 0.0
    num_prefill_steps = 0
    num_batched = 0
    while num_batched != num_requests or scheduler.num_waiting:
        sched_s, update_s, num_batched = _step(scheduler)
        prefill_s += sched_s + update_s
        num_prefill_steps += 1

    sched_total = update_total = 0.0
    for _ in range(num_steps):
        sched_s, update_s, num_batched = _step(scheduler)
        if num_batched != num_requests:
            raise RuntimeError(f"expected {num_requests} decodes in a step, got {num_batched}")
        sched_total += sched_s
        update_total += update_s
    step_us = (sched_total + update_total) / num_steps * 1e6
    return {
        "decode_step_us": step_us,
        "decode_schedule_us": sched_total / num_steps * 1e6,
        "decode_update_us": update_total / num_steps * 1e6,
        "decode_us_per_request": step_us / num_requests,
        "prefill_steps": num_prefill_steps,
        "prefill_ms_total": prefill_s * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--num-steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args(argv)
    result = run(
        args.num_requests,
        args.prompt_len,
        args.num_steps,
        args.block_size,
        not args.no_prefix_caching,
    )
    print(
        f"config: requests={args.num_requests} prompt_len={args.prompt_len} "
        f"steps={args.num_steps} block_size={args.block_size} "
        f"prefix_caching={not args.no_prefix_caching} python={platform.python_version()} "
        f"machine={platform.machine()}"
    )
    print(
        f"decode step: {result['decode_step_us']:.0f} us "
        f"(schedule {result['decode_schedule_us']:.0f} us + update "
        f"{result['decode_update_us']:.0f} us), "
        f"{result['decode_us_per_request']:.2f} us per request"
    )
    print(
        f"prefill of all prompts: {result['prefill_ms_total']:.1f} ms over "
        f"{result['prefill_steps']:.0f} steps"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
