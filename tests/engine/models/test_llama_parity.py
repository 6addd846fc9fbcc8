"""Greedy parity with transformers for small random-weight models of each supported family.

Each model is saved as a Hugging Face directory (config.json + safetensors) and loaded by both
engines from the same files: Qwen3 (per-head q/k norm, untied head, head_dim != hidden/heads),
Qwen2 (q/k/v bias) and Llama with llama3 rope scaling and a tied head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from davit_engine.layers.rotary import rope_inverse_frequencies
from davit_engine.llm import LLM
from davit_engine.loader import build_empty
from davit_engine.loader.random_weights import fill_random, save_hf_directory
from davit_engine.shapes import SHAPES
from davit_engine.types import ParamError, SamplingParams

MAX_NEW_TOKENS = 20
QWEN3_TINY = SHAPES["qwen3-tiny"]
VARIANTS = {
    "qwen2": dataclasses.replace(
        QWEN3_TINY, architecture="qwen2", qk_norm=False, attention_bias=True, head_dim=16
    ),
    "llama": dataclasses.replace(
        QWEN3_TINY,
        architecture="llama",
        qk_norm=False,
        tie_word_embeddings=True,
        num_kv_heads=1,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


def random_prompts() -> list[list[int]]:
    """22 prompts: 14 of lengths 1..150 and 8 sharing a 40-token prefix (prefix-cache hits)."""
    generator = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 256, (40,), generator=generator).tolist()
    lengths = (1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 70, 120, 150)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
    prompts += [
        shared + torch.randint(0, 256, (n,), generator=generator).tolist()
        for n in (1, 2, 5, 8, 9, 12, 20, 33)
    ]
    return prompts


def check_parity(directory: Path, hf_greedy: Callable[[Any, list[int], int], list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    prompts = random_prompts()
    llm = LLM(
        str(directory),
        tokenizer="byte",
        dtype="float32",
        block_size=8,
        num_gpu_blocks=256,
        max_num_batched_tokens=96,  # chunked prefill and staggered admission
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    hf_model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        assert out.token_ids == hf_greedy(hf_model, prompt, MAX_NEW_TOKENS), f"prompt {i}"
    assert llm.core.stats().prefix_cache_hits > 0


def test_qwen3_tiny_matches_transformers(
    qwen3_tiny_dir: Path, hf_greedy: Callable[[Any, list[int], int], list[int]]
) -> None:
    check_parity(qwen3_tiny_dir, hf_greedy)


@pytest.mark.parametrize("family", sorted(VARIANTS))
def test_family_matches_transformers(
    family: str,
    tmp_path: Path,
    hf_greedy: Callable[[Any, list[int], int], list[int]],
) -> None:
    model = build_empty(VARIANTS[family], torch.float32, torch.device("cpu"))
    fill_random(model, seed=3)
    save_hf_directory(model, tmp_path)
    check_parity(tmp_path, hf_greedy)


def test_llama3_rope_scaling_changes_only_long_wavelengths() -> None:
    scaling = VARIANTS["llama"].rope_scaling
    base = rope_inverse_frequencies(32, 500000.0, None)
    scaled = rope_inverse_frequencies(32, 500000.0, scaling)
    # Highest frequencies (short wavelengths) untouched, lowest divided by the factor.
    assert scaled[0] == base[0]
    assert torch.isclose(scaled[-1], base[-1] / 4.0)
    assert bool((scaled <= base).all())


def test_gguf_frequency_factors_divide_the_frequencies() -> None:
    base = rope_inverse_frequencies(8, 10000.0, None)
    factors = [1.0, 2.0, 4.0, 8.0]
    scaled = rope_inverse_frequencies(8, 10000.0, {"rope_type": "freq_factors", "factors": factors})
    assert torch.equal(scaled, base / torch.tensor(factors))
    with pytest.raises(ParamError, match="expected 4"):
        rope_inverse_frequencies(8, 10000.0, {"rope_type": "freq_factors", "factors": [1.0]})
    with pytest.raises(ParamError, match="'yarn' is not supported"):
        rope_inverse_frequencies(8, 10000.0, {"rope_type": "yarn"})


def test_random_weights_are_deterministic_by_seed() -> None:
    first = build_empty(QWEN3_TINY, torch.float32, torch.device("cpu"))
    second = build_empty(QWEN3_TINY, torch.float32, torch.device("cpu"))
    other = build_empty(QWEN3_TINY, torch.float32, torch.device("cpu"))
    fill_random(first, seed=5)
    fill_random(second, seed=5)
    fill_random(other, seed=6)
    for (name, a), b, c in zip(
        first.state_dict().items(),
        second.state_dict().values(),
        other.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name
        if a.numel() > 1:
            assert not torch.equal(a, c), name
