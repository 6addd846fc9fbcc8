"""The W2 bench variants worth a W2 run after a `gemm` run at one row: for each form of the
one-row product that the engine can switch on (two K steps a round at both tiles, where the
default takes it at 8 x 512 only; W streamed through 3 or 4 stages, with or without the first
tile before the wait), its cost is the sum over W2's four shapes of the tile the engine picks
there (8 x 512 at qkv and gate/up, 4 x 1,024 at o and down, on 132 multiprocessors); a form
more than 2% under the engine's default prints its variants, comma-separated, fastest first.
Streamed products are not in the norm chain's forms, so a streamed form prints with the norm
kernels (and that reference first).

    python3 hack/device/best_gemv.py $OUT/fp8.jsonl
"""

import json
import sys

TILE = {"qkv": "8x512", "gate_up": "8x512", "o": "4x1024", "down": "4x1024"}
FORMS = {
    "u2": "fp8-both-unroll2",
    "t3": "fp8-both-norm-kernels+fp8-both-stream3",
    "t4": "fp8-both-norm-kernels+fp8-both-stream4",
    "t3p": "fp8-both-norm-kernels+fp8-both-stream3-preload",
    "t4p": "fp8-both-norm-kernels+fp8-both-stream4-preload",
}


def main(path: str) -> None:
    with open(path) as lines:
        rows = [json.loads(line) for line in lines]
    rows = [r for r in rows if r.get("section") == "gemm" and r.get("rows") == 1]
    if {r["shape"] for r in rows} != set(TILE):
        return
    default = sum(r["default_us"] for r in rows)
    costs = {}
    for form in FORMS:
        keys = [(r, f"gemv_{TILE[r['shape']]}w4sauto{form}_us") for r in rows]
        if all(key in r for r, key in keys):
            costs[form] = sum(r[key] for r, key in keys)
    picked = sorted((c, f) for f, c in costs.items() if c < 0.98 * default)
    lines = []
    for _, form in picked:
        variant = FORMS[form]
        if "+" in variant and "fp8-both-norm-kernels" not in lines:
            lines.append("fp8-both-norm-kernels")
        lines.append(variant)
    print(",".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
