"""The W1 bench variant of the fastest FP8 decode tile in a `decode-tiles` run (summed over
W1's four steps), if it beats the engine's tile (the section's first row) by more than 2%;
nothing otherwise.

    python3 hack/device/best_tile.py $OUT/fp8.jsonl
"""

import json
import sys


def cost(row: dict) -> float:
    keys = [k for k in row if k.startswith("step") and k.endswith("_us")]
    return sum(row[k] for k in keys) if len(keys) == 4 else float("inf")


with open(sys.argv[1]) as lines:
    rows = [json.loads(line) for line in lines]
rows = [r for r in rows if r.get("section") == "decode-tiles"]
if rows:
    engine, best = rows[0], min(rows, key=cost)
    if cost(best) < 0.98 * cost(engine):
        block, warps, stages, cap = best["tile"].split("/")
        print(f"fp8-kv-tile-{block}x{warps}x{stages}{'' if int(cap) else '-nocap'}")
