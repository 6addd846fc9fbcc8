"""Could an FP8 LM head keep the greedy token exact? For each position of a real text, how many
vocabulary rows a rigorous bound on the FP8 logit's error leaves in contention with the top one.

An FP8 head would read half the bytes; it could keep bf16's greedy token if every row whose FP8
logit plus its error bound reaches the best row's FP8 logit minus its bound were recomputed from
the bf16 weight, with the full bf16 product as a fallback when more rows than a fixed candidate
count remain. This script measures, on SmolLM2-135M's final hidden states over the quality
tests' text, the error bounds one could compute and how often each would need the fallback:

- `cs-row` / `cs-gN`: Cauchy-Schwarz, ||h|| ||e_j|| (e_j = W_j - s_j q_j, the row's rounding
  residual), whole rows or per group of N columns (a table of residual norms per group);
- `residual`: sum |h_k| |e_jk| (needs |e|: a second table the size of W);
- `code-ulp`: s_j sum |h_k| ulp(q_jk) / 2 (from the FP8 codes alone: computable in the product's
  own pass);
- `code-16`: s_j sum |h_k| (|q_jk| / 16 + 2^-10) (the same with one more multiply-add).

    .venv/bin/python hack/fp8_lm_head_bounds.py [TOKENS]

The model is the tests' safetensors copy of SmolLM2-135M-Instruct (`tests/e2e/model_store`:
converted from the reference GGUF on first use, about a minute, and cached).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from davit_engine.quant.fp8_linear import quantize_channels

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests/data/text/tom-sawyer-chapter-1.txt"


def half_ulp(codes: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at each code (subnormals: 2^-10), as float32."""
    exponent = ((codes.view(torch.uint8).int() >> 3) & 15).clamp(min=1)
    return torch.exp2(exponent.float() - 7 - 4)


def main(tokens: int) -> None:
    sys.path.insert(0, str(ROOT))  # the tests' model store
    from tests.e2e.model_store import smollm2_safetensors

    path = smollm2_safetensors()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = tok(TEXT.read_text(), return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        h = model.model(ids).last_hidden_state[0].float()  # [T, K]
    weight = model.lm_head.weight.detach().float()  # [N, K], bf16 values
    codes, scale = quantize_channels(weight)
    dequantized = codes.float() * scale[:, None]
    residual = weight - dequantized
    exact = h @ weight.T
    fp8 = h @ dequantized.T
    error = (fp8 - exact).abs()
    k = weight.shape[1]
    bounds = {"cs-row": h.norm(dim=1)[:, None] * residual.norm(dim=1)[None, :]}
    for group in (64, 16, 4):
        if k % group == 0:
            hg = h.view(-1, k // group, group).norm(dim=2)
            eg = residual.view(-1, k // group, group).norm(dim=2)
            bounds[f"cs-g{group}"] = hg @ eg.T
    bounds["residual"] = h.abs() @ residual.abs().T
    bounds["code-ulp"] = scale[None, :] * (h.abs() @ half_ulp(codes).T)
    bounds["code-16"] = scale[None, :] * (h.abs() @ (codes.float().abs() / 16 + 2**-10).T)
    top2 = exact.topk(2, dim=1).values
    print(
        f"SmolLM2-135M LM head {tuple(weight.shape)}, {h.shape[0]} positions of {TEXT.name}; "
        f"mean |FP8 logit error| {error.mean():.4f}, median top-1 margin "
        f"{(top2[:, 0] - top2[:, 1]).median():.3f}"
    )
    print("bound       bound/error  rows in contention: median  p90  p99   fallback at 32/64/128")
    for name, bound in bounds.items():
        if not bool((error <= bound * (1 + 1e-5) + 1e-4).all()):
            raise AssertionError(f"{name} does not bound the error")
        floor = (fp8 - bound).max(dim=1).values
        contending = ((fp8 + bound) >= floor[:, None]).sum(dim=1).float()
        fallback = [float((contending > c).float().mean()) for c in (32, 64, 128)]
        print(
            f"{name:<10} {float(bound.mean() / error.mean()):>11.1f}  "
            f"{contending.median():>27.0f} {contending.quantile(0.9):>4.0f} "
            f"{contending.quantile(0.99):>4.0f}   " + " / ".join(f"{f:.1%}" for f in fallback)
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2048)
