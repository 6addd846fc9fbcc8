"""Greedy output of the engine vs Hugging Face transformers on the real SmolLM2-135M GGUF.

One batch of 22 chat prompts (every one longer than a 16-token block, lengths from ~35 to
~200 tokens, several sharing a long document prefix) runs through the engine in fp32 on the
CPU with a small token budget, so prefill is chunked, prompts are admitted over several steps
and later prompts hit the prefix cache. Every completion must equal transformers' `generate()`
token for token. The same reference answers check preemption under a tiny KV cache and that
a cached prefix is not recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from davit_engine.llm import LLM
from davit_engine.types import SamplingParams

MAX_NEW_TOKENS = 24
DOCUMENT = (
    "The Rhine is a river that begins in the Swiss Alps, forms part of the border between "
    "Switzerland and Liechtenstein, then Switzerland and Austria, and later Germany and "
    "France, before flowing through Germany and the Netherlands into the North Sea. It is "
    "one of the most important waterways in Europe, carrying barges loaded with coal, grain "
    "and containers between the port of Rotterdam and the industrial cities upstream."
)
QUESTIONS = [
    "What is the capital of France?",
    "Hi!",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to program, and explain why it helps beginners most.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one, in two sentences.",
    "What does a compiler do?",
    "Name a planet with rings.",
    "Why is the sky blue? Answer briefly, like you would to a curious eight-year-old child.",
    "Suggest a name for a small bakery.",
    "What is the boiling point of water at sea level in Celsius?",
    "Summarize the plot of Cinderella in one sentence.",
]
DOCUMENT_QUESTIONS = [
    "Where does the river begin?",
    "Which sea does it flow into?",
    "Which countries does it border?",
    "What do the barges carry?",
    "Name the port mentioned in the text.",
    "Is it important for Europe?",
]


def conversations() -> list[list[dict[str, str]]]:
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    convs += [[{"role": "user", "content": f"{DOCUMENT}\n\n{q}"}] for q in DOCUMENT_QUESTIONS]
    return convs


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path) -> LLM:
    # A 256-token budget chunks the long prompts and spreads admission over several steps.
    return LLM(
        str(smollm2_gguf),
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=256,
        num_gpu_blocks=512,
    )


@pytest.fixture(scope="module")
def prompts(engine: LLM) -> list[list[int]]:
    return [engine.tokenizer.apply_chat_template(c) for c in conversations()]


@pytest.fixture(scope="module")
def reference(
    hf_smollm2: tuple[Any, Any],
    hf_greedy: Callable[[Any, list[int], int], list[int]],
    prompts: list[list[int]],
) -> list[list[int]]:
    model, _ = hf_smollm2
    return [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts]


def test_chat_template_matches_transformers(
    hf_smollm2: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    _, hf_tokenizer = hf_smollm2
    for conv, ids in zip(conversations(), prompts, strict=True):
        expected = hf_tokenizer.apply_chat_template(conv, add_generation_prompt=True)
        expected = expected["input_ids"] if not isinstance(expected, list) else expected
        assert ids == list(expected)


def test_batch_greedy_matches_transformers(
    engine: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    lengths = [len(p) for p in prompts]
    assert min(lengths) > 16 and max(lengths) > 4 * 16 and len(set(lengths)) > 10
    before = engine.core.stats()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    after = engine.core.stats()
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        assert out.token_ids == ref, f"prompt {i} diverged from transformers"
        assert out.finish_reason == ("stop" if len(ref) < MAX_NEW_TOKENS else "length")
        assert out.text == engine.tokenizer.decode(ref)
    assert after.prefix_cache_hits > before.prefix_cache_hits
    assert any(out.num_cached_tokens > 0 for out in outputs)
    assert outputs[0].text.startswith("The capital of France is Paris")


def test_cached_prefix_is_not_recomputed(
    engine: LLM,
    prompts: list[list[int]],
    hf_smollm2: tuple[Any, Any],
    hf_greedy: Callable[[Any, list[int], int], list[int]],
) -> None:
    # A new question about the same document: its chat header + document prefix is in the
    # cache (from the batch test or from the warm-up here), the question is not.
    engine.generate([prompts[-1]], SamplingParams(max_tokens=1, temperature=0.0))
    conversation = [{"role": "user", "content": f"{DOCUMENT}\n\nHow long is the river?"}]
    prompt = engine.tokenizer.apply_chat_template(conversation)
    shared = next(i for i, (a, b) in enumerate(zip(prompt, prompts[-1], strict=False)) if a != b)
    block = engine.config.block_size
    runner = engine.core.runner
    before = runner.num_computed_tokens_total  # type: ignore[attr-defined]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    computed = runner.num_computed_tokens_total - before  # type: ignore[attr-defined]
    assert shared >= 4 * block
    assert out.num_cached_tokens == shared // block * block
    # Prefill ran only the uncached tail; each later step ran one token.
    assert computed == len(prompt) - out.num_cached_tokens + len(out.token_ids) - 1
    assert out.token_ids == hf_greedy(hf_smollm2[0], prompt, MAX_NEW_TOKENS)


def test_preemption_under_tiny_kv_cache_keeps_exact_output(
    smollm2_gguf: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # Eight prompts whose answers run the full MAX_NEW_TOKENS, with a KV cache that holds all
    # their prompts at admission (plus two spare blocks) but not their grown sequences: the
    # scheduler must preempt and recompute, and the tokens must come out exactly the same.
    long_answers = [i for i in range(len(prompts)) if len(reference[i]) == MAX_NEW_TOKENS]
    chosen = sorted(long_answers, key=lambda i: len(prompts[i]))[:8]
    block = 16
    at_admission = sum(-(-len(prompts[i]) // block) for i in chosen)
    at_end = sum(-(-(len(prompts[i]) + MAX_NEW_TOKENS) // block) for i in chosen)
    num_blocks = at_admission + 2
    assert len(chosen) == 8 and at_end > num_blocks
    llm = LLM(
        str(smollm2_gguf),
        dtype="float32",
        block_size=block,
        num_gpu_blocks=num_blocks,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
    )
    outputs = llm.generate(
        [prompts[i] for i in chosen], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    )
    stats = llm.core.stats()
    assert stats.num_preemptions > 0
    for i, out in zip(chosen, outputs, strict=True):
        assert out.token_ids == reference[i], f"prompt {i} changed after preemption"
    assert stats.num_free_blocks == stats.num_total_blocks
