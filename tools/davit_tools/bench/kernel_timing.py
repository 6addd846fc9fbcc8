"""Kernel timings on the GPU: one group of cases per flag, one JSON line per case on stdout.

    python3 -m davit_tools.bench.kernel_timing --sampling
    python3 -m davit_tools.bench.kernel_timing --sampling --rows 256 --logits 'randn*3'

Every line carries its configuration, the device and the software versions. `graph_us` is the
time per call inside one CUDA graph of `--replays` calls (no launch gaps: what a captured step
pays), the median of many graph replays; `eager_us` is the time per call of `--calls`
back-to-back eager calls between two CUDA events (launch overhead included, as an eager caller
pays it), the median of five such runs.

Groups:
- `--sampling`: `kernels/sampling.sample` for greedy, temperature 1, top-p 0.9, top-k 50 with
  top-p 0.9, and min-p 0.05 rows (every row of a case alike), at each `--rows` x `--vocab`, for
  each `--logits` distribution: `randn*3` (a few thousand tokens carry top-p 0.9's mass) and
  `randn*1` (flat: top-p 0.9 needs most of the vocabulary, the filter search's hardest case).
  A line also gives how its rows were drawn (`paths`: rows per FILTER_PATHS entry,
  `search_passes`: the mean over filtered rows), how many of the first `--check-rows` rows
  draw the same token as `sample_reference`, and, for filtered cases, `torch_sort_us`: a
  batched sort-based torch sampler with the same filters, graph-timed the same way, as a
  yardstick.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from davit_tools.bench.timing import eager_us, graph_us
from davit_tools.bench.workloads import W1

SAMPLING_CASES: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},
    "top_p=0.9": {"temperature": 1.0, "top_p": 0.9},
    "top_k=50,top_p=0.9": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    "min_p=0.05": {"temperature": 1.0, "min_p": 0.05},
}


def _versions() -> dict[str, str]:
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
    }


def _emit(group: str, **fields: Any) -> None:
    print(json.dumps({"group": group, **fields}), flush=True)


def _torch_sort_sampler(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B] float32, > 0
    top_k: torch.Tensor,  # [B] int32, 0 = off
    top_p: torch.Tensor,  # [B] float32
    min_p: torch.Tensor,  # [B] float32
) -> torch.Tensor:  # [B] int64
    """Top-k, top-p and min-p by one full sort per row, then an exponential race: the usual
    torch formulation, timed next to the kernels as a yardstick (its noise is torch's own)."""
    values, ids = torch.sort(logits * (1.0 / temperature)[:, None], dim=-1, descending=True)
    probs = torch.softmax(values, dim=-1)
    rank = torch.arange(values.shape[1], device=values.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    kept = torch.where(keep, probs, 0.0)
    cumulative = kept.cumsum(-1)
    keep &= cumulative - kept < top_p[:, None] * cumulative[:, -1:]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    race = torch.where(keep, probs / torch.empty_like(probs).exponential_(), -1.0)
    return ids.gather(1, race.argmax(-1, keepdim=True)).squeeze(1)


def _logits(name: str, rows: int, vocab: int) -> torch.Tensor:
    scale = float(name.removeprefix("randn*"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(rows, vocab, device="cuda", generator=gen) * scale


def time_sampling(args: argparse.Namespace) -> None:
    versions = _versions()
    for distribution in args.logits:
        for rows in args.rows:
            logits = _logits(distribution, rows, args.vocab)  # [B, V] float32
            for case, params in SAMPLING_CASES.items():
                fields = _time_sampling_case(args, logits, case, params)
                _emit("sampling", logits=distribution, **fields, **versions)
            del logits
            torch.cuda.empty_cache()


def _time_sampling_case(
    args: argparse.Namespace, logits: torch.Tensor, case: str, params: dict[str, float]
) -> dict[str, Any]:
    from davit_engine.kernels.sampling import (
        FILTER_PATHS,
        SamplingTable,
        sample,
        sample_reference,
        sample_with_paths,
    )

    rows, vocab = logits.shape
    slots = torch.arange(rows, dtype=torch.int32, device="cuda")
    positions = torch.full((rows,), 500, dtype=torch.int32, device="cuda")
    table = SamplingTable(
        temperature=torch.full((rows,), params["temperature"], device="cuda"),
        top_k=torch.full((rows,), int(params.get("top_k", 0)), dtype=torch.int32, device="cuda"),
        top_p=torch.full((rows,), params.get("top_p", 1.0), device="cuda"),
        min_p=torch.full((rows,), params.get("min_p", 0.0), device="cuda"),
        seed=slots.clone(),
    )
    filtered = any(key in params for key in ("top_k", "top_p", "min_p"))

    def draw() -> torch.Tensor:
        return sample(logits, slots, positions, table, any_filtered=filtered)

    tokens, paths = sample_with_paths(logits, slots, positions, table, any_filtered=filtered)
    checked = min(rows, args.check_rows)
    reference = sample_reference(logits[:checked], slots[:checked], positions[:checked], table)
    fields: dict[str, Any] = {
        "case": case,
        "rows": rows,
        "vocab": vocab,
        "dtype": "float32",
        "any_filtered": filtered,
        "graph_us": round(graph_us(draw, args.replays), 1),
        "eager_us": round(eager_us(draw, args.calls), 1),
        "matches_reference": f"{int((tokens[:checked] == reference).sum())}/{checked}",
    }
    if paths is not None:
        counts = torch.bincount(paths.path.long(), minlength=len(FILTER_PATHS)).tolist()
        fields["paths"] = {name: n for name, n in zip(FILTER_PATHS, counts, strict=True) if n}
        fields["search_passes"] = round(float(paths.search_passes.float().mean()), 2)

        def torch_draw() -> torch.Tensor:
            return _torch_sort_sampler(
                logits, table.temperature, table.top_k, table.top_p, table.min_p
            )

        fields["torch_sort_us"] = round(graph_us(torch_draw, max(1, args.replays // 4)), 1)
    fields["cuda_graph_replays"] = args.replays
    fields["eager_calls"] = args.calls
    return fields


GROUPS: dict[str, tuple[str, Callable[[argparse.Namespace], None]]] = {
    "sampling": ("time kernels/sampling.sample (see the module docstring)", time_sampling),
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [_positive_int(part) for part in text.split(",")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        ) from err


def _distributions(text: str) -> list[str]:
    names = text.split(",")
    for name in names:
        try:
            ok = name.startswith("randn*") and float(name.removeprefix("randn*")) > 0
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated 'randn*SCALE' with SCALE > 0, got {name!r}"
            )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, (help_text, _) in GROUPS.items():
        parser.add_argument(f"--{name}", action="store_true", help=help_text)
    # Defaults: one row, a mid batch and W1's full batch, over W1's vocabulary.
    w1 = W1()
    rows = [1, 64, w1.max_num_seqs]
    vocab = w1.shape().vocab_size
    parser.add_argument(
        "--rows",
        type=_int_list,
        default=rows,
        help=f"batch sizes (default {','.join(map(str, rows))})",
    )
    parser.add_argument(
        "--vocab", type=_positive_int, default=vocab, help=f"vocabulary (default {vocab})"
    )
    parser.add_argument(
        "--logits",
        type=_distributions,
        default=["randn*3", "randn*1"],
        help="logit distributions, 'randn*SCALE' (default randn*3,randn*1)",
    )
    parser.add_argument("--replays", type=_positive_int, default=20, help="calls per graph")
    parser.add_argument("--calls", type=_positive_int, default=50, help="eager calls per run")
    parser.add_argument(
        "--check-rows", type=_positive_int, default=16, help="rows compared to the reference"
    )
    args = parser.parse_args(argv)
    chosen = [name for name in GROUPS if getattr(args, name)]
    if not chosen:
        parser.error("pick at least one group: " + ", ".join(f"--{name}" for name in GROUPS))
    if not torch.cuda.is_available():
        print("kernel_timing: no CUDA device; it times GPU kernels only", file=sys.stderr)
        return 2
    for name in chosen:
        GROUPS[name][1](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
