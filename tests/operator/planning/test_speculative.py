"""features.speculative in the plan: the Davit release's methods run on runner V2, FLy is
passed with upstream's names and said in the RunnerSelected reason, a draft model is located
and mounted like the model and counted in the memory plan and the profile identity."""

from __future__ import annotations

import json
from typing import Any

import pytest

from davit_operator.planning.errors import PlanError
from davit_operator.planning.memory import profile_identity
from davit_operator.planning.plan import make_plan

from .test_capabilities import CATALOG, make_spec


def speculative_config(args: list[str]) -> dict[str, Any]:
    return dict(json.loads(args[args.index("--speculative-config") + 1]))


def test_ngram_plans_runner_v2_with_strict_verification() -> None:
    spec = make_spec(features={"speculative": {"method": "ngram", "numSpeculativeTokens": 3}})
    plan = make_plan("svc", "ns", spec, CATALOG)
    assert plan.runner.name == "v2"
    assert speculative_config(plan.invocation.args) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
    }
    assert "FLy" not in plan.runner.reason


def test_fly_is_in_the_effective_arguments_and_the_runner_reason() -> None:
    spec = make_spec(
        features={
            "speculative": {
                "method": "ngram",
                "numSpeculativeTokens": 4,
                "verification": "FLy",
                "fly": {"windowSize": 2, "entropyThreshold": 0.4, "entropyTopK": 4},
            }
        }
    )
    plan = make_plan("svc", "ns", spec, CATALOG)
    assert speculative_config(plan.invocation.args) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "rejection_sample_method": "fly",
        "fly_window_size": 2,
        "fly_entropy_threshold": 0.4,
        "fly_entropy_top_k": 4,
    }
    assert "FLy verification: lossy" in plan.runner.reason


def test_speculative_decoding_without_runner_v2_is_refused() -> None:
    spec = make_spec(
        accelerator={"vendor": "cpu", "product": None},
        features={"speculative": {"method": "ngram"}},
    )
    with pytest.raises(PlanError) as err:
        make_plan("svc", "ns", spec, CATALOG)
    assert "no runner of davit 0.1.0 serves this spec" in err.value.message


@pytest.mark.parametrize(
    ("draft", "location", "mounts"),
    [
        ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", []),
        ("hf://Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", []),
        ("random://qwen3-0.6b", "random:qwen3-0.6b", []),
        ("pvc://drafts/qwen3-0.6b", "/models/draft-drafts/qwen3-0.6b", ["draft-model:drafts"]),
        ("pvc://weights/qwen3-0.6b", "/models/weights/qwen3-0.6b", ["model:weights"]),
    ],
)
def test_a_draft_model_is_located_and_mounted_like_the_model(
    draft: str, location: str, mounts: list[str]
) -> None:
    source = {"source": "pvc://weights/qwen3-8b", "revision": None}
    spec = make_spec(
        model=source if draft.startswith("pvc://weights") else {},
        features={"speculative": {"method": "draft_model", "draftModel": draft}},
    )
    plan = make_plan("svc", "ns", spec, CATALOG)
    assert speculative_config(plan.invocation.args)["model"] == location
    got = [f"{m.volume_name}:{m.claim_name}" for m in plan.invocation.model_mounts]
    if draft.startswith("pvc://weights"):
        assert got == ["model:weights"]
    else:
        assert got == mounts


def test_the_memory_plan_and_the_profile_identity_count_the_draft_model() -> None:
    plain = make_plan("svc", "ns", make_spec(), CATALOG)
    spec = make_spec(
        features={"speculative": {"method": "draft_model", "draftModel": "Qwen/Qwen3-0.6B"}}
    )
    drafted = make_plan("svc", "ns", spec, CATALOG)
    assert plain.memory is not None and drafted.memory is not None
    assert plain.memory.weights_bytes is not None and drafted.memory.weights_bytes is not None
    assert drafted.memory.weights_bytes > plain.memory.weights_bytes
    assert plain.memory.token_capacity is not None and drafted.memory.token_capacity is not None
    assert drafted.memory.token_capacity < plain.memory.token_capacity
    assert "speculative" in profile_identity(drafted)
    assert "speculative" not in profile_identity(plain)
    assert drafted.memory.identity_hash != plain.memory.identity_hash
