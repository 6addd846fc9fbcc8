"""What the selected runner can run: per-request refusals name the field; V1-only features."""

from __future__ import annotations

import pytest
import torch

from davit_engine.runner.capability import check_request, v1_only_features
from davit_engine.runner.sampler import register_logits_processor, unregister_logits_processor
from davit_engine.types import ParamError, SamplingParams


def keep(_: object, logits: torch.Tensor) -> torch.Tensor:
    return logits


@pytest.mark.parametrize(
    ("runner", "prompt", "sampling", "param"),
    [
        ("v1", [1, 2], SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
        ("v2", [1, 2], SamplingParams(logits_processors=("test-keep",)), "logits_processors"),
        ("v1", [1, 2], SamplingParams(logits_processors=("missing",)), "logits_processors"),
        ("v1", [1, 100], SamplingParams(), "prompt"),
        ("v2", [-1], SamplingParams(), "prompt"),
        ("v1", [1], SamplingParams(stop_token_ids=(100,)), "stop_token_ids"),
    ],
)
def test_refusals_name_the_field(
    runner: str, prompt: list[int], sampling: SamplingParams, param: str
) -> None:
    register_logits_processor("test-keep", keep)
    try:
        with pytest.raises(ParamError) as err:
            check_request(runner, 100, prompt, sampling)
        assert err.value.param == param
    finally:
        unregister_logits_processor("test-keep")


def test_what_each_runner_runs() -> None:
    register_logits_processor("test-keep", keep)
    try:
        check_request("v1", 100, [0, 99], SamplingParams(logits_processors=("test-keep",)))
        assert v1_only_features() == ["custom logits processors (test-keep)"]
    finally:
        unregister_logits_processor("test-keep")
    check_request("v2", 100, [0, 99], SamplingParams(stop_token_ids=(99,)))
    assert v1_only_features() == []
