"""GPU timing helpers shared by the kernel benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch


def graph_us(fn: Callable[[], Any], replays: int = 50) -> float:
    """Microseconds per call of `fn` captured `replays` times in one CUDA graph (no launch
    gaps: what a captured step pays), the median over many replays of the graph."""
    from triton.testing import do_bench

    stream = torch.cuda.Stream()  # compile and warm the allocator outside the capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    ms = do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    return 1e3 * float(ms) / replays


def eager_us(fn: Callable[[], Any], calls: int, runs: int = 5) -> float:
    """Microseconds per call of `fn` over `calls` back-to-back eager calls (median of runs)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(times)
