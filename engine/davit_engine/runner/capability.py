"""What the selected runner, with its model, can run: the one place that says so.

Checked at startup (`v1_only_features`: features in use that only runner V1 implements, which
runner selection turns into a choice or a refusal) and for every request the engine core admits
(`check_request`). Each refusal is a ParamError naming the request field.
"""

from __future__ import annotations

from collections.abc import Sequence

from davit_engine.runner.sampler import check_logits_processors, registered_logits_processors
from davit_engine.types import ParamError, SamplingParams

# Runners that apply custom logits processors (the torch sampler's, per row).
_LOGITS_PROCESSOR_RUNNERS = ("v1",)


def v1_only_features() -> list[str]:
    """Features in use that only runner V1 implements."""
    features = []
    registered = registered_logits_processors()
    if registered:
        names = ", ".join(registered)
        features.append(f"custom logits processors ({names})")
    return features


def check_request(
    runner: str, vocab_size: int, prompt_token_ids: Sequence[int], sampling: SamplingParams
) -> None:
    """Refuse a request that runner `runner` cannot run on a model of `vocab_size` tokens."""
    if sampling.prompt_logprobs is not None:
        # RunnerOutput has no field for per-prompt-token logprobs yet.
        raise ParamError("prompt_logprobs", "prompt_logprobs is not supported by this engine")
    if sampling.logits_processors:
        if runner not in _LOGITS_PROCESSOR_RUNNERS:
            raise ParamError(
                "logits_processors", "custom logits processors need the engine's --runner v1"
            )
        check_logits_processors(sampling.logits_processors)
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ParamError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad_stop = next((t for t in sampling.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad_stop is not None:
        raise ParamError(
            "stop_token_ids",
            f"token id {bad_stop} is outside the vocabulary [0, {vocab_size})",
        )
