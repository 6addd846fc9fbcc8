"""Skinny matrix products `y = x @ W.T (+ b)` for decode at small batch, and the table that
decides, per weight shape and row count, whether they beat the library GEMM.

At one to a few rows a linear layer is a pure stream of its weight matrix; a decode step of an
8B model is ~15 GB of such streams. The kernel gives each program `BLOCK_N` output features and
walks the reduction dimension in `BLOCK_K` chunks, so every weight byte is read once with no
split-K reduction pass; rows of `x` are few enough to stay in registers. `GemvPlan.tune()`
times every candidate configuration and the library call on the real weights (inside CUDA
graphs, weights cycled beyond the L2 cache) and keeps a Triton configuration only where it is
faster: the table is measured, not assumed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

logger = logging.getLogger(__name__)

# DAVIT_TRITON_GEMV: "auto" (measure per shape, default), "off" (library GEMM always), "on"
# (the first candidate wherever eligible, without measuring; for tests and experiments).
MODE_ENV = "DAVIT_TRITON_GEMV"
ROW_BUCKETS = (1, 2, 4, 8)
MAX_ROWS = ROW_BUCKETS[-1]


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def label(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"


CANDIDATES: tuple[GemvConfig, ...] = (
    GemvConfig(16, 512, 4, 4),
    GemvConfig(8, 512, 4, 4),
    GemvConfig(32, 256, 4, 4),
    GemvConfig(16, 256, 4, 6),
    GemvConfig(64, 128, 8, 4),
)


@triton.jit
def _gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    num_rows,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    feature_valid = features < n
    row_valid = rows < num_rows
    w_rows = w_ptr + features.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < k
        w = tl.load(w_rows + ks[None, :], mask=feature_valid[:, None] & k_valid[None, :], other=0.0)
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        # [BLOCK_M, 1, BLOCK_K] x [1, BLOCK_N, BLOCK_K] summed over K, in fp32
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc += tl.sum(prod, 2)
    if HAS_BIAS:
        bias = tl.load(b_ptr + features, mask=feature_valid, other=0.0).to(tl.float32)
        acc += bias[None, :]
    dst = y_ptr + rows[:, None] * stride_ym + features[None, :]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=row_valid[:, None] & feature_valid[None, :])


def _block_m(num_rows: int) -> int:
    return max(1, triton.next_power_of_2(num_rows))


def gemv(
    x: torch.Tensor,  # [M, K], rows contiguous, M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None,  # [N] or None
    config: GemvConfig,
) -> torch.Tensor:  # [M, N] in x's dtype
    num_rows, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert num_rows <= MAX_ROWS
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_m = _block_m(num_rows)
    # keep the per-thread product tile bounded as rows grow
    block_k = max(32, config.block_k // block_m)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def gemv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """fp32 accumulation of the same product, rounded once to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Half-precision CUDA inputs of at most MAX_ROWS rows (fp32 stays on the library path,
    whose results the exactness checks compare against)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


@dataclass
class Timing:
    """One measured shape: microseconds per call of the library and of each candidate."""

    n: int
    k: int
    rows: int
    library_us: float
    candidates_us: dict[str, float]
    chosen: str | None

    def as_dict(self) -> dict[str, object]:
        bytes_read = self.n * self.k * 2
        best = min([self.library_us, *self.candidates_us.values()])
        return {
            "n": self.n,
            "k": self.k,
            "rows": self.rows,
            "library_us": round(self.library_us, 2),
            "candidates_us": {c: round(t, 2) for c, t in self.candidates_us.items()},
            "chosen": self.chosen or "library",
            "best_tb_per_s": round(bytes_read / best / 1e6, 3),
        }


@dataclass
class GemvPlan:
    """`(N, K, row bucket) -> GemvConfig` where the Triton kernel was measured faster."""

    mode: str = "auto"
    table: dict[tuple[int, int, int], GemvConfig] = field(default_factory=dict)
    timings: list[Timing] = field(default_factory=list)

    @staticmethod
    def from_env() -> GemvPlan:
        mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
        if mode not in ("auto", "off", "on"):
            raise ValueError(f"{MODE_ENV} must be auto, off or on, not {mode!r}")
        return GemvPlan(mode=mode)

    def choose(self, x: torch.Tensor, weight: torch.Tensor) -> GemvConfig | None:
        if self.mode == "off" or not eligible(x, weight):
            return None
        if self.mode == "on":
            return CANDIDATES[0]
        bucket = next(b for b in ROW_BUCKETS if b >= x.shape[0])
        return self.table.get((weight.shape[0], weight.shape[1], bucket))

    def tune(self, weights: list[torch.Tensor], repeats: int = 20) -> None:
        """Measure each distinct weight shape at every row bucket (CUDA, half precision)."""
        if self.mode != "auto":
            return
        seen: set[tuple[int, int, torch.dtype]] = set()
        for weight in weights:
            key = (weight.shape[0], weight.shape[1], weight.dtype)
            if (
                key in seen
                or not weight.is_cuda
                or weight.dtype
                not in (
                    torch.bfloat16,
                    torch.float16,
                )
            ):
                continue
            seen.add(key)
            copies = _copies_beyond_l2(weight)
            for rows in ROW_BUCKETS:
                timing = _time_shape(copies, rows, repeats)
                self.timings.append(timing)
                if timing.chosen is not None:
                    config = next(c for c in CANDIDATES if c.label() == timing.chosen)
                    self.table[(timing.n, timing.k, rows)] = config
            del copies
        if self.timings:
            logger.info(
                "skinny GEMM table: %d of %d (shape, rows) cases use the Triton kernel",
                len(self.table),
                len(self.timings),
            )


_L2_SPAN_BYTES = 256 << 20


def _copies_beyond_l2(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight plus copies so that cycling through them never hits in the L2 cache."""
    size = weight.numel() * weight.element_size()
    count = max(1, -(-_L2_SPAN_BYTES // max(size, 1)))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def _graph_time_us(fn_list: list[object], repeats: int) -> float:
    """Microseconds per call of the callables, captured back to back in one CUDA graph."""
    calls = [f for f in fn_list if callable(f)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in calls:  # warm-up outside the capture (compilation, library heuristics)
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for f in calls:
                f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / (repeats * len(calls))


def _time_shape(copies: list[torch.Tensor], rows: int, repeats: int) -> Timing:
    weight = copies[0]
    n, k = weight.shape
    x = torch.randn(rows, k, dtype=weight.dtype, device=weight.device)

    def library(w: torch.Tensor) -> object:
        return lambda: torch.nn.functional.linear(x, w)

    def triton_call(w: torch.Tensor, config: GemvConfig) -> object:
        return lambda: gemv(x, w, None, config)

    library_us = _graph_time_us([library(w) for w in copies], repeats)
    measured: dict[str, float] = {}
    for config in CANDIDATES:
        if triton.cdiv(n, config.block_n) < 1:
            continue
        try:
            measured[config.label()] = _graph_time_us(
                [triton_call(w, config) for w in copies], repeats
            )
        except (RuntimeError, OutOfResources, CompilationError) as exc:  # beyond this GPU
            logger.debug("gemv %s at %dx%d: %s", config.label(), n, k, exc)
    chosen = None
    if measured:
        best = min(measured, key=measured.__getitem__)
        if measured[best] < library_us * 0.98:
            chosen = best
    return Timing(n, k, rows, library_us, measured, chosen)
