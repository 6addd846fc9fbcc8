"""FP8 quality on real weights: SmolLM2-135M (the reference GGUF) on the CPU in bf16, as a GPU
serves it, where FP8 is stored and computed as CUDA rounds it (quant/fp8_linear.py,
layers/attention.py), against the unquantized bf16 model.

Figures (tools/davit_tools/bench/fp8_quality.py): perplexity of Chapter I of Tom Sawyer
(tests/data/text/, 3,654 tokens, in 512-token prefill chunks over a paged cache of the
configuration's element type) and greedy agreement over 32 prompts cut from the same text (48
tokens each, 32 greedy tokens, through the engine core). The issue's goals: perplexity within
1% of the baseline with an FP8 KV cache, within 2% with FP8 weights. Each test prints its
figures; docs/fp8.md records them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.loader import load_model
from davit_engine.quant.fp8_linear import Fp8Linear
from davit_engine.tokenizer import load_tokenizer
from davit_tools.bench.fp8_quality import (
    CONFIGS,
    agreement,
    measure,
    perplexity,
    write_block_fp8_checkpoint,
)

pytestmark = pytest.mark.slow

TEXT = Path(__file__).resolve().parents[2] / "data" / "text" / "tom-sawyer-chapter-1.txt"
CPU = torch.device("cpu")
BY_NAME = {c.name: c for c in CONFIGS}


@pytest.fixture(scope="module")
def base_config(smollm2_gguf: Path) -> EngineConfig:
    # bf16, as a GPU serves it (the goals are against bf16). Small limits: 32 prompts of
    # 48 + 32 tokens fit, prefill is chunked over a few steps.
    return EngineConfig(
        model=str(smollm2_gguf), device="cpu", dtype="bfloat16", max_model_len=512,
        max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks=256,
    )  # fmt: skip


@pytest.fixture(scope="module")
def token_ids(base_config: EngineConfig) -> list[int]:
    return load_tokenizer(base_config).encode(TEXT.read_text())


@pytest.fixture(scope="module")
def baseline(base_config: EngineConfig, token_ids: list[int]) -> dict[str, Any]:
    return measure(base_config, BY_NAME["baseline"], token_ids, CPU)


def _compare(
    name: str, base_config: EngineConfig, token_ids: list[int], baseline: dict[str, Any]
) -> tuple[float, Any]:
    figures = measure(base_config, BY_NAME[name], token_ids, CPU)
    change = figures["perplexity"] / baseline["perplexity"] - 1
    agree = agreement(baseline["completions"], figures["completions"])
    print(
        f"\n{name}: perplexity {figures['perplexity']:.3f} vs {baseline['perplexity']:.3f} "
        f"({100 * change:+.2f}%); greedy {agree.as_dict()}"
    )
    return change, agree


def test_text_is_a_few_thousand_tokens(token_ids: list[int]) -> None:
    assert 3000 <= len(token_ids) <= 4000


def test_fp8_kv_cache(
    base_config: EngineConfig, token_ids: list[int], baseline: dict[str, Any]
) -> None:
    change, agree = _compare("fp8-kv", base_config, token_ids, baseline)
    assert abs(change) < 0.01  # the goal: within 1%
    # Greedy agreement depends on the CPU: near-ties break differently with its vector width
    # (in float32: 31 / 18.2 on one machine, 31 / 14.7 on another; in bf16: 29 / 15.0); the
    # bounds leave room for that.
    assert agree.first_token >= 26 and agree.mean_common_prefix >= 10


def test_fp8_weights(
    base_config: EngineConfig, token_ids: list[int], baseline: dict[str, Any]
) -> None:
    """The prefill chunks run the FP8 library GEMM's arithmetic (activations quantized per
    token, float32 products rounded once to bf16) except at q/k/v, whose inputs are never
    quantized (512-row chunks: the library GEMM on W widened exactly, then scaled): +1.70% when
    measured (+1.51% with q/k/v's float32 product, +2.08% on the same CPU with q/k/v's inputs
    quantized too, +1.61% on another)."""
    change, agree = _compare("fp8-weights", base_config, token_ids, baseline)
    assert abs(change) < 0.02  # the goal: within 2%
    # Measured in bf16: 31 of 32 first tokens, 10.0 tokens in common on average (27 / 8.3 on
    # another CPU before q/k/v's inputs were kept; bf16's own rounding leaves more near-ties
    # than float32, where it was 31 / 10.7).
    assert agree.first_token >= 24 and agree.mean_common_prefix >= 5


def test_fp8_weights_weight_only_product(
    base_config: EngineConfig, token_ids: list[int], baseline: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(Fp8Linear, "weight_only_max_rows", 1 << 30)
    loaded = load_model(dataclasses.replace(base_config, quantization="fp8"), CPU)
    change = perplexity(loaded, token_ids, CPU) / baseline["perplexity"] - 1
    print(f"\nfp8-weights, weight-only product: perplexity {100 * change:+.2f}%")
    assert abs(change) < 0.02  # the goal: within 2%


def test_fp8_weights_and_kv_cache(
    base_config: EngineConfig, token_ids: list[int], baseline: dict[str, Any]
) -> None:
    change, agree = _compare("fp8-both", base_config, token_ids, baseline)
    assert abs(change) < 0.035  # measured +2.36%: the weights' +1.70% and the cache's +0.40%
    # A 135M model has many near-ties: completions part after a few tokens (7.5 on average in
    # bf16), but the first token agrees in most prompts (29 of 32).
    assert agree.first_token >= 24 and agree.mean_common_prefix >= 5


def test_fp8_lm_head(
    base_config: EngineConfig, token_ids: list[int], baseline: dict[str, Any]
) -> None:
    """--lm-head-quantization fp8 on top of FP8 weights, with and without the FP8 KV cache
    (W2's fastest configuration): the head's own rounding; its inputs are never quantized
    (the weight-only product at every row count, as for q/k/v)."""
    change, agree = _compare("fp8-weights-lm-head", base_config, token_ids, baseline)
    assert abs(change) < 0.04  # measured +3.12%: the weights' +1.70% and the head's
    assert agree.first_token >= 22 and agree.mean_common_prefix >= 4
    change, agree = _compare("fp8-both-lm-head", base_config, token_ids, baseline)
    assert abs(change) < 0.05  # measured +3.93%
    assert agree.first_token >= 22 and agree.mean_common_prefix >= 4


def test_int8_lm_head(
    base_config: EngineConfig, token_ids: list[int], baseline: dict[str, Any]
) -> None:
    """--lm-head-quantization int8 on top of FP8 weights, with and without the FP8 KV cache:
    the same bytes as an FP8 head, about a quarter of its logit error (weight-only, float32
    products rounded once)."""
    change, agree = _compare("fp8-weights-lm-head-int8", base_config, token_ids, baseline)
    assert abs(change) < 0.02  # the FP8 weights' goal, head included
    assert agree.first_token >= 24 and agree.mean_common_prefix >= 5
    change, agree = _compare("fp8-both-lm-head-int8", base_config, token_ids, baseline)
    assert abs(change) < 0.035  # as FP8 weights and KV without it
    assert agree.first_token >= 24 and agree.mean_common_prefix >= 5


def test_block_fp8_checkpoint(
    base_config: EngineConfig, token_ids: list[int], baseline: dict[str, Any],
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """SmolLM2 written as a block-wise FP8 checkpoint (128 x 128 blocks, `weight_scale_inv`:
    Qwen3's FP8 layout), which the loader re-quantizes to channel scales
    (quant/block_fp8.py). The checkpoint's own values (dequantized exactly, run in bf16)
    measured +2.09% against the bf16 baseline; as loaded, with the weight-only product
    everywhere (the conversion's rounding alone), +1.99%; as served (prefill chunks quantize
    the activations per token) +2.59%. Choosing each row's scale from its largest value instead
    (not the rule kept) measured +4.38% weight-only. With torch 2.15: as written +2.05%,
    weight-only +1.80%, served +2.27%; served with its own block scales
    (`--fp8-block-scales native`: no activation is quantized at this model's shapes, W's values
    rounded to bf16 once at prefill's 512-row chunks) +2.05%, the checkpoint's own figure."""
    from davit_engine.loader import gguf_file

    config, weights = gguf_file.load(smollm2_gguf)
    write_block_fp8_checkpoint(config, weights, tmp_path / "blk", as_written=tmp_path / "written")
    figures = {}
    for name, model, scales in (
        ("as written", "written", "channel"),
        ("served", "blk", "channel"),
        ("native", "blk", "native"),
    ):
        loaded = load_model(dataclasses.replace(base_config, model=str(tmp_path / model),
                                                fp8_block_scales=scales), CPU)  # fmt: skip
        figures[name] = perplexity(loaded, token_ids, CPU)
        del loaded
    assert load_model(dataclasses.replace(base_config, model=str(tmp_path / "blk")), CPU
                      ).quantization == "fp8"  # fmt: skip
    monkeypatch.setattr(Fp8Linear, "weight_only_max_rows", 1 << 30)
    loaded = load_model(dataclasses.replace(base_config, model=str(tmp_path / "blk")), CPU)
    figures["weight-only"] = perplexity(loaded, token_ids, CPU)
    change = {k: v / baseline["perplexity"] - 1 for k, v in figures.items()}
    print("\nblock-wise FP8 checkpoint: " + ", ".join(
        f"{k} {figures[k]:.3f} ({100 * v:+.2f}%)" for k, v in change.items()))  # fmt: skip
    # the conversion costs no more than rounding noise on top of the checkpoint's own values
    assert change["weight-only"] <= change["as written"] + 0.005
    assert 0 < change["served"] < 0.035
    # served with its own scales (--fp8-block-scales native): the checkpoint's values, so its
    # perplexity is the one they give in bf16, to the rounding of the products' sums
    assert abs(change["native"] - change["as written"]) < 0.003
