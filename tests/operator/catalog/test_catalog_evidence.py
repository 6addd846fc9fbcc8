"""The catalog's vLLM facts agree with the committed release evidence.

The evidence files (tools/davit_tools/catalog/evidence/vllm-VERSION.json) are what the catalog
tool read from each release's wheel and what the release's own CLI made of the operator's
command lines. Reads only committed files: no wheel, no network. When a release is added or the
tool is run again, this test says which catalog entry disagrees.
"""

from __future__ import annotations

import json
import typing
from functools import cache

import pytest

from davit_operator.api.spec import SpeculativeMethod
from davit_operator.catalog.loader import Release, load_catalog
from davit_operator.catalog.rules import EFFECTS, Condition
from davit_tools.catalog.evidence import EVIDENCE_DIR
from davit_tools.catalog.schema import Evidence, Feature

VLLM = load_catalog().engines.engines["vllm"]
RELEASES = tuple(VLLM.versions)
API_METHODS: tuple[str, ...] = typing.get_args(SpeculativeMethod)
SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
# The list each effect comes from (evidence `featureLists[].role`).
EFFECT_ROLE = {
    "selectsV1OnAuto": "v2Unsupported",
    "refusedOnV2": "v2Unsupported",
    "refusedOnV1": "v1Unsupported",
    "refused": "runnerUnsupported",
    "refusedOnStandaloneCpu": "standaloneCpuUnsupported",
}
# What in a release's condition text each operator condition reads.
MARKERS: dict[Condition, tuple[str, ...]] = {
    "sequenceParallelism": ("enable_sp",),
    "dualBatchOverlap": ("use_ubatching", "enable_dbo"),
    "elasticExpertParallelism": ("enable_elastic_ep",),
    "customLogitsProcessors": ("logits_processors",),
    "tensorParallelism": ("tensor_parallel_size > 1",),
    "pipelineParallelism": ("pipeline_parallel_size > 1",),
    "speculativeDecoding": ("speculative_config",),
    "speculativeMethod": ("speculative_config.method",),
    "lora": ("lora_config",),
    "model": ("ROCM_DEFAULT_MRV1_ARCHITECTURES", "_is_default_v2_model_runner_model"),
}
# Release conditions that read a setting the operator sets, whose rule the operator still does
# not evaluate, and why.
NOT_EVALUATED = {
    "pipeline parallelism with external_launcher": "the operator never sets the executor",
    "pipeline parallelism with async scheduling": "async scheduling stays off for V1 with "
    "pipeline parallelism unless asked for; the operator never asks",
    "parallel drafting for EAGLE speculative decoding": "the operator never sets it",
    "heterogeneous-vocabulary draft models": "depends on the draft model's vocabulary",
    "adaptive verification with LoRA": "the operator never enables adaptive verification",
    "adaptive verification with enforce_eager/cudagraph_mode=none": "never enabled",
    "adaptive verification with pipeline parallelism": "never enabled",
    "adaptive draft verification": "never enabled",
    "dspark speculative decoding": "not a method of the API",
    "xpress speculative decoding": "not a method of the API",
    "draft lm_head quantization": "the operator never sets it",
    "Parse 3.5 MTP": "depends on the draft model's architecture",
    "dual batch overlap with context parallelism": "the API has no context parallelism",
    "dual batch overlap with prefill context parallelism": "the API has no context parallelism",
    "dual batch overlap with multimodal models": "depends on the model",
    "dual batch overlap with hybrid models": "depends on the model",
    "dual batch overlap with encoder only models": "depends on the model",
    "dual batch overlap with PIECEWISE CUDA graphs": "depends on the compilation mode",
    "multimodal tower and connector LoRA": "the operator never sets it",
}

# What the contract check records for a line whose VLLM_* variables the release accepts: "ok"
# from the release's own validate_environ, or, for releases without one (0.28.0 to 0.30.0),
# that there is nothing to check.
ENVIRON_PASSED = ("ok", "no environment validation in this release")


@cache
def evidence(version: str) -> Evidence:
    return Evidence.model_validate(json.loads((EVIDENCE_DIR / f"vllm-{version}.json").read_text()))


def release(version: str) -> Release:
    found = VLLM.release(version)
    assert found is not None
    return found


def items(version: str, role: str, text: str) -> list[Feature]:
    return [
        item
        for feature_list in evidence(version).feature_lists
        if feature_list.role == role
        for item in feature_list.items
        if item.text == text
    ]


def test_every_catalogued_release_has_its_evidence_file() -> None:
    files = sorted(p.name for p in EVIDENCE_DIR.glob("vllm-*.json"))
    assert files == sorted(f"vllm-{v}.json" for v in RELEASES)
    for version in RELEASES:
        assert release(version).evidence == f"vllm-{version}.json"
        assert evidence(version).published


@pytest.mark.parametrize("version", RELEASES)
def test_wheel_facts(version: str) -> None:
    facts, found = release(version).wheel, evidence(version)
    assert facts is not None and found.artifact is not None and found.build is not None
    assert facts.sha256 == found.artifact.sha256
    assert facts.cuda == found.build.cuda.version
    assert facts.torch == found.build.pins.torch


@pytest.mark.parametrize("version", RELEASES)
def test_runners_and_the_switch(version: str) -> None:
    """The runners the wheel ships, the variable it reads, and what it does with each value."""
    entry, found = release(version), evidence(version)
    assert found.runners is not None and found.switch is not None
    assert found.selection is not None and found.contract is not None
    shipped = {
        runner
        for runner, has in (("v1", found.runners.has_v1), ("v2", found.runners.has_v2))
        if has
    }
    assert set(entry.runners) == shipped
    assert entry.default_runner == "v2"
    probes = {
        line.name: line for line in found.contract.command_lines if line.name.startswith("switch:")
    }
    if len(entry.runners) == 2:
        # The release decides between two runners and reads the variable in that decision.
        assert found.selection.method is not None
        assert found.selection.steps[-1].outcome == "returns True", "V2 unless a step says no"
        assert entry.runner_switch is not None and entry.runner_switch.kind == "env"
        assert entry.runner_switch.name == found.switch.name == SWITCH
        assert found.switch.declared and "maybe_convert_bool" in str(found.switch.parse)
        assert entry.runner_switch.values == {"v1": "0", "v2": "1"}
        for value in ("0", "1"):
            assert probes[f"switch:{SWITCH}={value}"].environ in ENVIRON_PASSED
    else:
        # 0.34.0: no decision, the variable is no longer declared; =0 is refused, =1 accepted.
        assert found.selection.method is None and not found.switch.declared
        assert entry.runner_switch is None
        refused = probes[f"switch:{SWITCH}=0"].environ or ""
        assert "Model Runner V1 has been removed" in refused
        assert probes[f"switch:{SWITCH}=1"].environ == "ok"
        last = VLLM.last_with("v1", before=version)
        assert last is not None and evidence(last.version).runners.has_v1  # type: ignore[union-attr]


@pytest.mark.parametrize("version", RELEASES)
def test_runner_rules_are_the_release_lists_word_for_word(version: str) -> None:
    summary = evidence(version).summary
    assert summary is not None
    for effect in EFFECTS:
        catalogued = {r.text for r in release(version).runner_rules if effect in r.effects}
        assert catalogued == set(summary.effects.get(effect, [])), effect


def _methods(condition: str) -> list[str]:
    """The API's speculative methods for which the release's condition text holds (the text is
    Python read from the release's source; only its speculative part is evaluated)."""

    class Namespace:
        def __init__(self, **values: object) -> None:
            self.__dict__.update(values)

        def __getattr__(self, name: str) -> None:
            return None

    matched = []
    for method in API_METHODS:
        names = {
            "speculative_config": Namespace(method=method, parallel_drafting=False),
            "self": Namespace(parallel_config=Namespace(pipeline_parallel_size=2)),
            "getattr": getattr,
        }
        # The text is committed evidence (Python read from the release), evaluated without builtins.
        if eval(condition, {"__builtins__": {}}, names):
            matched.append(method)
    return matched


@pytest.mark.parametrize("version", RELEASES)
def test_each_evaluated_rule_reads_the_release_condition(version: str) -> None:
    for rule in release(version).runner_rules:
        if rule.when is None:
            continue
        if "model" in rule.when:
            assert any(m in rule.text for m in MARKERS["model"]), rule.text
            assert rule.note, f"{rule.text}: a model rule says in plain words what it covers"
            continue
        roles = {EFFECT_ROLE[e] for e in rule.effects if e in EFFECT_ROLE}
        found = [item for role in roles for item in items(version, role, rule.text)]
        assert found, f"{rule.text}: no list item of {roles}"
        for item in found:
            for condition in rule.when:
                assert any(m in item.condition for m in MARKERS[condition]), (
                    rule.text,
                    condition,
                    item.condition,
                )
            if rule.methods is not None:
                assert rule.methods == _methods(item.condition), (rule.text, item.condition)
        if "refusedOnStandaloneCpu" in rule.effects:
            assert rule.variants == ["cpu"]


@pytest.mark.parametrize("version", RELEASES)
def test_what_the_operator_sets_is_evaluated(version: str) -> None:
    """Every list item whose condition reads something the operator sets is evaluated, unless
    NOT_EVALUATED says why not."""
    settable = [m for c, markers in MARKERS.items() if c != "model" for m in markers]
    rules = {r.text: r for r in release(version).runner_rules}
    for feature_list in evidence(version).feature_lists:
        for item in feature_list.items:
            if not any(m in item.condition for m in settable) or item.text in NOT_EVALUATED:
                continue
            if item.text not in rules:  # a list nothing consumes (it extends another list)
                assert not feature_list.consumers
                continue
            assert rules[item.text].when is not None, (item.text, item.condition)


@pytest.mark.parametrize("version", RELEASES)
def test_capabilities_and_arguments(version: str) -> None:
    entry, found = release(version), evidence(version)
    assert found.speculative_methods is not None and found.pass_config is not None
    known = {m for m, named in found.speculative_methods.operator.items() if named}
    assert set(entry.capabilities.speculative_methods or API_METHODS) == known
    # engine.quantization / engine.kvCacheDtype: recorded as the release's own Literals say
    assert found.precision is not None
    for recorded, values in (
        (entry.capabilities.quantization, found.precision.quantization),
        (entry.capabilities.kv_cache_dtypes, found.precision.kv_cache_dtypes),
    ):
        assert recorded is not None, version
        assert set(recorded) == {v for v, named in values.operator.items() if named}
    key = found.pass_config.sequence_parallelism_key
    spelling = entry.arguments.sequence_parallelism
    assert (spelling.pass_config_key if spelling else None) == key
    assert ("sequenceParallelism" in entry.capabilities.unsupported_features) == (key is None)
    if key is not None:
        assert key in {f.name for f in found.pass_config.fields}
    # What the release's own parser made of each candidate key.
    assert found.contract is not None
    for line in found.contract.command_lines:
        if line.name.startswith("probe:pass_config."):
            assert line.parsed == (line.name == f"probe:pass_config.{key}"), line.name


@pytest.mark.parametrize("version", RELEASES)
def test_every_operator_line_parses_with_the_release(version: str) -> None:
    """Each example's and typed feature's command line for this release parses with its own
    `vllm serve` and builds its engine arguments; the variables the operator sets pass its
    environment check. A line is empty only where the operator refuses the spec."""
    contract = evidence(version).contract
    assert contract is not None and contract.checked
    for line in contract.command_lines:
        if not line.name.startswith(("example:", "feature:")):
            continue
        if not line.args:
            assert line.planner.startswith("refused: "), line.name
            continue
        assert line.parsed, (line.name, line.error)
        assert line.engine_args == "ok", (line.name, line.engine_args)
        if line.planner == "accepted":
            assert line.environ in ENVIRON_PASSED, (line.name, line.environ)
