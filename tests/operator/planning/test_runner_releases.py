"""Runner selection per vLLM release, as each release's wheel decides it.

Every expectation here is read from the committed evidence (tools/davit_tools/catalog/evidence/
vllm-VERSION.json: `summary.effects` and the feature lists' conditions); the comments name the
release's own wording. tests/operator/catalog/test_catalog_evidence.py checks that the catalog
records those lists word for word; this file pins what planning makes of them.
"""

from __future__ import annotations

from typing import Any

import pytest

from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import Plan, make_plan
from davit_operator.status.compute import compute_status
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
RELEASES = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
TWO_RUNNERS = RELEASES[:-1]
SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
DBO = {"dualBatchOverlap": True, "expert": {"enabled": True}}
LORA = ["--enable-lora"]
CPU_IMAGE = {"image": "registry.example/vllm-cpu:v0.34.0"}


def spec(version: str, **overrides: Any) -> Any:
    engine = {"type": "vllm", "version": version, **overrides.pop("engine", {})}
    return make_spec(engine=engine, **overrides)


def plan(version: str, **overrides: Any) -> Plan:
    return make_plan("svc", "ns", spec(version, **overrides), CATALOG)


def refusal(version: str, **overrides: Any) -> PlanError:
    with pytest.raises(PlanError) as err:
        plan(version, **overrides)
    return err.value


def switch_env(p: Plan) -> str | None:
    return next((e["value"] for e in p.invocation.env if e["name"] == SWITCH), None)


@pytest.mark.parametrize(
    ("version", "runner"),
    # "custom logits processors" is in the V2-unsupported list of 0.28.0-0.30.0 only.
    [("0.28.0", "v1"), ("0.29.0", "v1"), ("0.30.0", "v1")]
    + [(v, "v2") for v in ("0.31.0", "0.32.0", "0.33.0", "0.34.0")],
)
def test_custom_logits_processors(version: str, runner: str) -> None:
    p = plan(version, features={"customLogitsProcessors": ["acme.logits:NoRepeat"]})
    assert p.runner.name == runner
    assert p.runner.is_fallback == (runner == "v1")
    assert switch_env(p) is None


@pytest.mark.parametrize("version", ["0.28.0", "0.29.0"])
def test_dual_batch_overlap_needs_v1_up_to_029(version: str) -> None:
    """ "dual batch overlap" is unconditionally V2-unsupported: V1 on auto, forced V2 refused."""
    p = plan(version, parallelism=DBO)
    assert p.runner.name == "v1" and "(dual batch overlap)" in p.runner.reason
    assert "engine.runner: v2 runs it on V2" not in p.runner.reason
    err = refusal(version, parallelism=DBO, engine={"runner": "v2"})
    assert err.reason == "RunnerUnsupported" and err.field == "parallelism.dualBatchOverlap"
    assert f"runner V2 of vllm {version} refuses parallelism.dualBatchOverlap" in err.message


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.32.0", "0.33.0"])
def test_dual_batch_overlap_goes_to_v1_on_auto_and_v2_only_when_forced(version: str) -> None:
    """0.30.0-0.33.0: "dual batch overlap" sends the release to V1 while VLLM_USE_V2_MODEL_RUNNER
    is unset; once it is set, V2 refuses it only "with LoRA", "with speculative decoding", "with
    pipeline parallelism" (and model-dependent combinations)."""
    auto = plan(version, parallelism=DBO)
    assert auto.runner.name == "v1" and auto.runner.is_fallback
    assert auto.runner.reason == (
        f"parallelism.dualBatchOverlap (dual batch overlap) is not supported by runner V2 of "
        f"vllm {version}; the release falls back to V1 by itself (deprecated); engine.runner: "
        "v2 runs it on V2"
    )
    assert switch_env(auto) is None
    forced = plan(version, parallelism=DBO, engine={"runner": "v2"})
    assert forced.runner.name == "v2" and switch_env(forced) == "1"
    assert forced.runner.reason == f"engine.runner is v2 ({SWITCH}=1)"
    for overrides, wording in (
        ({"parallelism": {**DBO, "pipeline": 2}}, "dual batch overlap with pipeline parallelism"),
        ({"parallelism": DBO, "engine": {"extraArgs": LORA}}, "dual batch overlap with LoRA"),
        (
            {
                "parallelism": DBO,
                "features": {"speculative": {"method": "eagle", "draftModel": "a/b"}},
            },
            "dual batch overlap with speculative decoding",
        ),
    ):
        engine = {"runner": "v2", **overrides.pop("engine", {})}  # type: ignore[dict-item]
        err = refusal(version, engine=engine, **overrides)
        assert err.reason == "RunnerUnsupported", wording
        assert f"({wording})" in err.message
        assert "set engine.runner: auto or change parallelism.dualBatchOverlap" in err.message
        # Left to itself the release runs them on V1, which has no such refusal.
        engine.pop("runner")
        assert plan(version, engine=engine, **overrides).runner.name == "v1"


def test_vllm_034_serves_dual_batch_overlap_but_not_with_pipeline_or_lora() -> None:
    """0.34.0's only runner refuses "dual batch overlap with pipeline parallelism" and "with
    LoRA" (`_get_model_runner_unsupported_features`), not dual-batch overlap alone."""
    p = plan("0.34.0", parallelism=DBO)
    assert p.runner.name == "v2" and p.runner.reason == "V2 is the only runner of vllm 0.34.0"
    assert "--enable-dbo" in p.invocation.args and switch_env(p) is None
    err = refusal("0.34.0", parallelism={**DBO, "pipeline": 2})
    assert (err.field, err.value, err.reason) == (
        "parallelism.dualBatchOverlap",
        True,
        "NoRunnerSupports",
    )
    assert err.message == (
        "no runner of vllm 0.34.0 serves this spec: runner V2 refuses "
        "parallelism.dualBatchOverlap with parallelism.pipeline 2 (dual batch overlap with "
        "pipeline parallelism); runner V1 was last shipped in 0.33.0; change "
        "parallelism.dualBatchOverlap, parallelism.pipeline, or serve it with engine.version "
        "0.28.0 to 0.33.0"
    )
    err = refusal("0.34.0", parallelism=DBO, engine={"extraArgs": LORA})
    assert err.reason == "NoRunnerSupports" and err.field == "parallelism.dualBatchOverlap"
    assert "with engine.extraArgs --enable-lora (dual batch overlap with LoRA)" in err.message
    # A forced V2 is the same runner: the same refusal, as RunnerUnsupported.
    err = refusal("0.34.0", parallelism={**DBO, "pipeline": 2}, engine={"runner": "v2"})
    assert err.reason == "RunnerUnsupported" and "set engine.runner: auto" not in err.message


@pytest.mark.parametrize("version", TWO_RUNNERS)
def test_a_forced_runner_sets_the_variable_the_release_reads(version: str) -> None:
    for runner, value in (("v1", "0"), ("v2", "1")):
        p = plan(version, engine={"runner": runner})
        assert p.runner.name == runner and switch_env(p) == value
    assert switch_env(plan(version)) is None, "auto leaves the decision to the release"


def test_vllm_034_reads_no_runner_variable() -> None:
    """0.34.0 refuses VLLM_USE_V2_MODEL_RUNNER=0 in validate_environ ("Model Runner V1 has been
    removed") and only logs =1: a forced V1 is refused, a forced V2 sets nothing."""
    err = refusal("0.34.0", engine={"runner": "v1"})
    assert (err.field, err.reason) == ("engine.runner", "RunnerUnavailable")
    assert "V1 was last shipped in 0.33.0: pin engine.version <= 0.33.0" in err.message
    p = plan("0.34.0", engine={"runner": "v2"})
    assert switch_env(p) is None
    assert p.runner.reason == (
        "engine.runner is v2; V2 is the only runner of vllm 0.34.0, which reads no runner switch"
    )


@pytest.mark.parametrize(
    ("version", "method", "runner"),
    [
        # "ngram/ngram_gpu speculative decoding" (0.28-0.29), then the method tuple of
        # "speculative method '{...}'" (0.30: ngram, draft_model, suffix, medusa, mlp_speculator,
        # custom_class; 0.31: draft_model left; 0.32: ngram left; 0.33: only suffix, custom_class).
        *[(v, "ngram", "v1") for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0")],
        *[(v, "ngram", "v2") for v in ("0.32.0", "0.33.0", "0.34.0")],
        *[(v, "draft_model", "v1") for v in ("0.28.0", "0.29.0", "0.30.0")],
        *[(v, "draft_model", "v2") for v in ("0.31.0", "0.32.0", "0.33.0", "0.34.0")],
        *[(v, "medusa", "v1") for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")],
        *[(v, "eagle", "v2") for v in RELEASES],
    ],
)
def test_speculative_methods(version: str, method: str, runner: str) -> None:
    speculative: dict[str, Any] = {"method": method}
    if method != "ngram":
        speculative["draftModel"] = "Qwen/Qwen3-0.6B"
    p = plan(version, features={"speculative": speculative})
    assert p.runner.name == runner
    if runner == "v1":
        assert f"features.speculative.method {method}" in p.runner.reason


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_medusa_is_no_method_of_033_and_later(version: str) -> None:
    err = refusal(version, features={"speculative": {"method": "medusa", "draftModel": "a/b"}})
    assert err.reason == "UnsupportedByEngine"
    assert "or serve it with engine.version 0.28.0 to 0.32.0" in err.message


@pytest.mark.parametrize(("version", "runner"), [("0.28.0", "v1"), ("0.29.0", "v1")])
def test_eagle3_with_pipeline_parallelism(version: str, runner: str) -> None:
    speculative = {"method": "eagle3", "draftModel": "a/b"}
    p = plan(version, features={"speculative": speculative}, parallelism={"pipeline": 2})
    assert p.runner.name == runner and "(EAGLE3 with pipeline parallelism)" in p.runner.reason
    later = plan("0.30.0", features={"speculative": speculative}, parallelism={"pipeline": 2})
    assert later.runner.name == "v2"


@pytest.mark.parametrize(
    ("version", "runner"),
    [(v, "v1") for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0")]
    + [(v, "v2") for v in ("0.32.0", "0.33.0", "0.34.0")],
)
def test_elastic_expert_parallelism(version: str, runner: str) -> None:
    p = plan(version, parallelism={"tensor": 2, "expert": {"enabled": True, "elastic": True}})
    assert p.runner.name == runner


@pytest.mark.parametrize("version", ["0.28.0", "0.29.0", "0.30.0", "0.31.0"])
def test_sequence_parallelism_uses_the_release_key(version: str) -> None:
    """PassConfig.enable_sp (0.28.0-0.31.0), and "sequence parallelism" sends them to V1."""
    p = plan(version, parallelism={"tensor": 2, "sequenceParallelism": True})
    args = p.invocation.args
    assert args[args.index("--compilation-config") + 1] == '{"pass_config":{"enable_sp":true}}'
    assert p.runner.name == "v1" and "(sequence parallelism)" in p.runner.reason


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])
def test_sequence_parallelism_is_refused_where_the_release_has_no_setting(version: str) -> None:
    err = refusal(version, parallelism={"tensor": 2, "sequenceParallelism": True})
    assert (err.field, err.reason) == ("parallelism.sequenceParallelism", "UnsupportedByEngine")
    assert err.message == (
        f"vllm {version} does not support parallelism.sequenceParallelism; remove "
        "parallelism.sequenceParallelism, or serve it with engine.version 0.28.0 to 0.31.0"
    )


def test_vllm_034_cpu_names_its_standalone_runner_limits() -> None:
    """0.34.0's x86 CPU runner is MRV2-based and serves what V2 serves; the standalone CPU
    runner (used only on non-x86 CPUs without Triton) refuses "custom logits processors" and
    "speculative decoding". Whether an image has Triton is not recorded: status names the limit
    unless the pods are pinned to amd64."""
    cpu: dict[str, Any] = {"accelerator": {"vendor": "cpu", "product": None}}
    features = {"customLogitsProcessors": ["a.b:C"], "speculative": {"method": "ngram"}}
    p = plan("0.34.0", engine=CPU_IMAGE, features=features, **cpu)
    assert p.runner.name == "v2"
    assert p.runner.reason == (
        "V2 is the only runner of vllm 0.34.0; on a non-x86 CPU without Triton vllm 0.34.0 runs "
        "its standalone CPU runner, which refuses features.speculative (speculative decoding), "
        "features.customLogitsProcessors (custom logits processors); pod.nodeSelector "
        "kubernetes.io/arch: amd64 avoids it"
    )
    arm = plan(
        "0.34.0",
        engine=CPU_IMAGE,
        features=features,
        pod={"nodeSelector": {"kubernetes.io/arch": "arm64"}},
        **cpu,
    )
    assert "runs its standalone CPU runner, which refuses" in arm.runner.reason
    assert "avoids it" not in arm.runner.reason
    x86 = plan(
        "0.34.0",
        engine=CPU_IMAGE,
        features=features,
        pod={"nodeSelector": {"kubernetes.io/arch": "amd64"}},
        **cpu,
    )
    assert x86.runner.reason == "V2 is the only runner of vllm 0.34.0"
    plain = plan("0.34.0", engine=CPU_IMAGE, **cpu)
    assert plain.runner.reason == "V2 is the only runner of vllm 0.34.0"


def test_a_release_newer_than_the_catalog_needs_an_image() -> None:
    err = refusal("0.35.0")
    assert (err.field, err.reason, err.condition) == (
        "engine.version",
        "UncataloguedVersion",
        "ImageResolved",
    )
    assert "the newest is 0.34.0" in err.message and "set engine.image" in err.message
    p = plan("0.35.0", engine={"image": "vllm/vllm-openai:v0.35.0"})
    assert p.image.engine_version == "0.35.0" and p.image.assumed_release == "0.34.0"
    assert p.image.release_title is None and p.image.source == "override"
    assert p.runner.reason == "V2 is the only runner of vllm 0.34.0"
    # The newest release's rules apply: a forced V1 is refused as on 0.34.0.
    err = refusal("0.35.0", engine={"image": "vllm/vllm-openai:v0.35.0", "runner": "v1"})
    assert err.reason == "RunnerUnavailable" and "last shipped in 0.33.0" in err.message
    status = compute_status(
        plan=p, error=None, deployment=None, old_status={}, generation=1, now="t"
    )
    conds = {c.type: c for c in status.conditions}
    assert conds["Uncatalogued"].status == "True"
    assert conds["Uncatalogued"].reason == "NewerThanCatalog"
    assert conds["Uncatalogued"].message.startswith(
        f"vllm 0.35.0 is not in catalog {CATALOG.version} (the newest vllm release there is "
        "0.34.0); it runs engine.image vllm/vllm-openai:v0.35.0"
    )
    assert "assumed, not verified" in conds["Uncatalogued"].message
    assert status.artifact is not None and status.artifact.engine_version == "0.35.0"
    catalogued = compute_status(
        plan=plan("0.34.0"), error=None, deployment=None, old_status={}, generation=1, now="t"
    )
    assert "Uncatalogued" not in {c.type for c in catalogued.conditions}


def test_versions_inside_the_catalog_range_stay_refused() -> None:
    for version in ("0.33.1", "0.27.0"):
        err = refusal(version, engine={"image": "vllm/vllm-openai:v" + version})
        assert err.reason == "UnknownVersion" and "known versions: 0.28.0" in err.message
