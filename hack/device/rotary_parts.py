"""Where the FP8 cache's rotary launch spends the time it takes beyond the bf16 cache's: the
launch timed with its parts switched on one at a time (queries times H, keys times H, the FP8
cache store), at W1's decode step (256 tokens, 16/8 heads), W1's prefill chunk (8,192) and W2's
token (32/8), inside CUDA graphs (us); with `forms`, the launch's forms instead (two programs a
token or one; 4, 8 and 16 warps) at 1 to 256 tokens. Prints one JSON line per case.
Exploratory (bench notes, run 32).

    . hack/device/env.sh && python3 hack/device/rotary_parts.py [forms]
"""

from __future__ import annotations

import json
import sys
from unittest import mock

import torch

from davit_engine.kernels import layer_ops
from davit_tools.bench.fp8 import rotary_step
from davit_tools.bench.timing import graph_us

CASES = (("w1-decode", 256, 16, 8), ("w1-prefill", 8192, 16, 8), ("w2", 1, 32, 8))


FORMS = (
    ("split", {"ROTARY_SPLIT_QK": True}),
    ("one", {"ROTARY_SPLIT_QK": False}),
    ("one_16w", {"ROTARY_SPLIT_QK": False, "ROTARY_FP8_NUM_WARPS": 16}),
    ("one_4w", {"ROTARY_SPLIT_QK": False, "ROTARY_FP8_NUM_WARPS": 4}),
    ("split_16w", {"ROTARY_FP8_NUM_WARPS": 16}),
)
FORM_CASES = tuple((f"t{tokens}", tokens, *heads) for tokens in (1, 16, 64, 128, 256)
                   for heads in ((16, 8), (32, 8)))  # fmt: skip


def case(label: str, tokens: int, hq: int, hkv: int, forms: bool = False) -> dict[str, object]:
    q, k, v, cos, sin, w, slots, scale, by_fp8 = rotary_step(tokens, hq, hkv)
    caches = {torch.bfloat16: by_fp8[False], torch.float8_e4m3fn: by_fp8[True]}

    def launch(dtype: torch.dtype, rotate_queries: bool) -> None:
        fp8 = dtype != torch.bfloat16
        layer_ops.qk_norm_rope(
            q, k, cos, sin, w[0], w[1], 1e-6, v=v, kv_cache=caches[dtype],
            slot_mapping=slots, kv_scale=scale if fp8 else None,
            rotate_queries=rotate_queries,
        )  # fmt: skip

    row: dict[str, object] = {"case": label, "tokens": tokens, "heads": f"{hq}/{hkv}"}
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    if forms:
        for name, switches in FORMS:
            with mock.patch.multiple(layer_ops, **switches):
                row[name] = graph_us(lambda: launch(fp8, True), 20)
        return row
    row["bf16"] = graph_us(lambda: launch(bf16, False), 20)
    row["bf16_q_rotated"] = graph_us(lambda: launch(bf16, True), 20)
    row["fp8_full"] = graph_us(lambda: launch(fp8, True), 20)
    row["fp8_q_unrotated"] = graph_us(lambda: launch(fp8, False), 20)
    with mock.patch.object(layer_ops, "rotates_keys", lambda dim: False):
        row["fp8_nothing_rotated"] = graph_us(lambda: launch(fp8, False), 20)
    for name, value in (("ROTARY_FP8_NUM_WARPS", 4), ("ROTARY_HADAMARD_FROM_MEMORY", False),
                        ("ROTARY_SPLIT_QK", False), ("ROTARY_LOADS_BEFORE_WAIT", False)):  # fmt: skip
        with mock.patch.object(layer_ops, name, value):
            row[f"fp8_full_{name}={value}"] = graph_us(lambda: launch(fp8, True), 20)
    return row


def main() -> None:
    forms = sys.argv[1:] == ["forms"]
    for label, tokens, hq, hkv in FORM_CASES if forms else CASES:
        row = case(label, tokens, hq, hkv, forms)
        print(json.dumps({key: round(val, 2) if isinstance(val, float) else val
                          for key, val in row.items()}), flush=True)  # fmt: skip
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
