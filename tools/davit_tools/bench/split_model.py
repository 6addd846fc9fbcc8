"""A model of decode attention over a workload's spread of contexts: how the ways of splitting
the key range fill the GPU's program slots. No GPU: it reports key units (the keys a program
walks plus a fixed cost per program), not microseconds, to compare the ways with each other.

    python -m davit_tools.bench.split_model            # W1, the H200's 132 multiprocessors

Each decode step of the workload (requests still running at their prompt plus the step's keys,
the batch padded to the CUDA-graph size the V2 runner replays) becomes the attention launch's
programs, one per (request, KV head, split) in the order the GPU starts them (requests fastest,
then heads, then splits), each costing its keys plus `--fixed` (an empty one `--empty`). Slots
per multiprocessor are the decode tile's (`paged_attention.DECODE_PROGRAMS_PER_SM`); a program
takes the first slot that frees (list scheduling); a step lasts until its last program ends.
What it leaves out: a program alone on a multiprocessor runs faster than one among eight (the
model charges the same per key), the merge kernel (a fixed `--merge` per split step), and
prefill steps.

Ways, each for the model-dtype cache and the FP8 one: the engine's splits (`engine`), every
context at the step's mean (`mean`: what a uniform-length kernel timing measures), split
targets of other waves (`waves-N`), and balanced splits at N waves (`balanced-N`).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from davit_contract.graphs import graph_batch_sizes
from davit_tools.bench.workloads import W1, OfflineWorkload


@dataclass(frozen=True)
class Way:
    """One way of splitting: `waves_times` multiplies the cache kind's split waves
    (`SPLIT_WAVES`), `balanced` turns balanced splits on at that many waves; `mean` puts every
    context at the step's mean."""

    name: str
    waves_times: float | None = None
    balanced: float | None = None
    mean: bool = False


def program_keys(
    contexts: list[int],
    num_kv_heads: int,
    num_splits: int,
    block_n: int = 64,
    balanced_programs: int | None = None,
    min_split_tiles: int = 2,
) -> list[int]:
    """Keys each program of one decode launch walks, in launch order (requests fastest, then
    KV heads, then splits): proportional runs (each request's tiles in `num_splits` runs), or
    with `balanced_programs` the kernel's balanced run (`_balanced_split_tiles`)."""
    tiles = [math.ceil(c / block_n) for c in contexts]
    if balanced_programs is not None and num_splits > 1:
        per_program = math.ceil(sum(tiles) * num_kv_heads / balanced_programs)
        covering = math.ceil(max(tiles, default=0) / num_splits)
        run = max(per_program, covering, min_split_tiles)
        runs = [[run] * num_splits for _ in tiles]
    else:
        runs = [[math.ceil(t / num_splits)] * num_splits for t in tiles]
    keys = []
    for split in range(num_splits):
        for _ in range(num_kv_heads):
            for t, run_of in zip(tiles, runs, strict=True):
                begin = split * run_of[split]
                keys.append(max(0, min(begin + run_of[split], t) - begin) * block_n)
    return keys


def makespan(keys: list[int], slots: int, fixed: float, empty: float) -> float:
    """Key units until the last program ends, each taking the first free slot in order."""
    if not keys:
        return 0.0
    free = [0.0] * min(slots, len(keys))
    heapq.heapify(free)
    end = 0.0
    for k in keys:
        start = heapq.heappop(free)
        stop = start + (k + fixed if k > 0 else empty)
        end = max(end, stop)
        heapq.heappush(free, stop)
    return end


@contextlib.contextmanager
def engine_settings(
    fp8: bool,
    waves_times: float | None = None,
    balanced: float | None = None,
    multiprocessors: int | None = None,
) -> Iterator[Any]:
    """The paged-attention module with a way's switches for the cache kind (`waves_times`
    multiplies its `SPLIT_WAVES`; `balanced`: balanced splits at that many waves) and, given
    `multiprocessors`, a GPU of that many; all restored afterwards."""
    from davit_engine.kernels import paged_attention as pa

    kind = pa._cache_kind(fp8)
    saved = (pa.multiprocessors, pa.SPLIT_WAVES, pa.BALANCE_SPLITS, pa.BALANCED_WAVES)
    if multiprocessors is not None:
        pa.multiprocessors = lambda device: multiprocessors
    if waves_times is not None:
        pa.SPLIT_WAVES = {**pa.SPLIT_WAVES, kind: waves_times * pa.SPLIT_WAVES[kind]}
    if balanced is not None:
        pa.BALANCE_SPLITS = True
        pa.BALANCED_WAVES = {**pa.BALANCED_WAVES, kind: balanced}
    try:
        yield pa
    finally:
        pa.multiprocessors, pa.SPLIT_WAVES, pa.BALANCE_SPLITS, pa.BALANCED_WAVES = saved


def launch_units(
    contexts: list[int],
    num_kv_heads: int,
    splits: int,
    balanced_programs: int | None,
    fp8: bool,
    multiprocessors: int,
    fixed: float,
    empty: float,
    merge: float,
) -> float:
    """Key units of one decode launch: its programs (`program_keys`, at the decode tile's keys
    per tile) over the tile's slots on `multiprocessors`, and the merge where it splits."""
    from davit_engine.kernels import paged_attention as pa

    block_n = 64 if splits <= 8 or fp8 else 32  # the decode tiles' keys per tile
    keys = program_keys(contexts, num_kv_heads, splits, block_n, balanced_programs)
    slots = pa.DECODE_PROGRAMS_PER_SM[pa._cache_kind(fp8)] * multiprocessors
    return makespan(keys, slots, fixed, empty) + (merge if splits > 1 else 0.0)


def decode_steps(workload: OfflineWorkload) -> Iterator[list[int]]:
    """Each decode step's contexts: the requests still running, at prompt plus step."""
    inputs, outputs = workload.lengths()
    step = 1
    while True:
        contexts = [i + step for i, o in zip(inputs, outputs, strict=True) if o > step]
        if not contexts:
            return
        yield contexts
        step += 1


def run_way(
    workload: OfflineWorkload,
    way: Way,
    fp8: bool,
    num_kv_heads: int,
    multiprocessors: int,
    fixed: float,
    empty: float,
    merge: float,
) -> float:
    """Key units of every decode step of `workload` one way, summed."""
    import torch

    sizes = graph_batch_sizes(workload.max_num_seqs)
    device = torch.device("cuda")  # the split choice's GPU path; nothing runs on it
    total = 0.0
    with engine_settings(fp8, way.waves_times, way.balanced, multiprocessors) as pa:
        for contexts in decode_steps(workload):
            if way.mean:
                contexts = [round(sum(contexts) / len(contexts))] * len(contexts)
            padded = next(s for s in sizes if s >= len(contexts))
            splits = pa.default_num_splits(
                padded, num_kv_heads, workload.max_model_len, device, fp8=fp8
            )
            programs = None
            if way.balanced is not None and padded > 1:
                programs = pa.balanced_split_programs(device, fp8)
            total += launch_units(
                contexts + [0] * (padded - len(contexts)), num_kv_heads, splits, programs, fp8,
                multiprocessors, fixed, empty, merge,
            )  # fmt: skip
    return total


WAYS = (
    Way("engine"),
    Way("mean", mean=True),
    Way("waves-0.5x", waves_times=0.5),
    Way("waves-2x", waves_times=2.0),
    Way("balanced-2", balanced=2.0),
    Way("balanced-3", balanced=3.0),
    Way("balanced-4", balanced=4.0),
)


def main(argv: list[str] | None = None) -> int:
    from davit_engine.kernels import paged_attention as pa

    parser = argparse.ArgumentParser(prog="python -m davit_tools.bench.split_model")
    parser.add_argument("--multiprocessors", type=int, default=132)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--fixed", type=float, default=80.0, help="key units per program")
    parser.add_argument("--empty", type=float, default=20.0, help="key units per empty program")
    parser.add_argument("--merge", type=float, default=20.0, help="key units per split step")
    args = parser.parse_args(argv)
    if min(args.multiprocessors, args.kv_heads) < 1 or min(args.fixed, args.empty, args.merge) < 0:
        parser.error("--multiprocessors and --kv-heads must be positive, costs not negative")
    workload = W1()
    config = {"workload": "W1", **vars(args)}
    print(json.dumps({"config": config}))
    for fp8 in (False, True):
        kind = pa._cache_kind(fp8)
        base = None
        for way in WAYS:
            units = run_way(
                workload, way, fp8, args.kv_heads, args.multiprocessors, args.fixed, args.empty,
                args.merge,
            )  # fmt: skip
            base = base or units
            row = {"cache": kind, "way": way.name, "key_units_k": round(units / 1e3),
                   "over_engine": round(units / base, 3)}  # fmt: skip
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
