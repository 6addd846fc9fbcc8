"""Which of a release's runner rules hold for a spec: the spec facts a rule's conditions read.

A catalog rule (catalog/rules.py) names conditions such as `dualBatchOverlap` and
`pipelineParallelism`; this module reads them off the spec, says which spec fields make a rule
hold (for messages and the field a refusal names), and fills the release's wording in.
"""

from __future__ import annotations

from dataclasses import dataclass

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.base import FeatureName
from davit_operator.catalog.loader import Release
from davit_operator.catalog.rules import Condition, Effect, RunnerRule

# Spec path of each catalog feature, for messages.
FEATURE_FIELDS: dict[FeatureName, str] = {
    "sequenceParallelism": "parallelism.sequenceParallelism",
    "dualBatchOverlap": "parallelism.dualBatchOverlap",
    "elasticExpertParallelism": "parallelism.expert.elastic",
    "customLogitsProcessors": "features.customLogitsProcessors",
}
LORA_FLAG = "--enable-lora"
METHOD_PLACEHOLDER = "{speculative_config.method}"


@dataclass(frozen=True)
class Match:
    """A rule that holds for the spec: the spec fields that make it hold (`fields`, with the
    value of the first in `value`) and how to name them (`subject`)."""

    rule: RunnerRule
    fields: tuple[str, ...]
    value: object
    subject: str

    def wording(self, spec: InferenceServiceSpec) -> str:
        """The release's own words, with the speculative method filled in."""
        method = spec.features.speculative.method if spec.features.speculative else ""
        return self.rule.text.replace(METHOD_PLACEHOLDER, method)


def requested_features(spec: InferenceServiceSpec) -> list[FeatureName]:
    """Catalog feature names the spec turns on, in a stable order."""
    found: list[FeatureName] = []
    if spec.parallelism.sequence_parallelism:
        found.append("sequenceParallelism")
    if spec.parallelism.dual_batch_overlap:
        found.append("dualBatchOverlap")
    if spec.parallelism.expert.elastic:
        found.append("elasticExpertParallelism")
    if spec.features.custom_logits_processors:
        found.append("customLogitsProcessors")
    return found


def has_lora(spec: InferenceServiceSpec) -> bool:
    """LoRA is turned on through engine.extraArgs (the API has no field for it)."""
    return any(arg.split("=", 1)[0] == LORA_FLAG for arg in spec.engine.extra_args)


def _condition(
    condition: Condition, rule: RunnerRule, spec: InferenceServiceSpec
) -> tuple[bool, str, object, str]:
    """(holds, spec field, its value, how to name it) of one condition for `spec`."""
    p, speculative = spec.parallelism, spec.features.speculative
    if condition in FEATURE_FIELDS:
        field = FEATURE_FIELDS[condition]
        on = condition in requested_features(spec)
        return on, field, True, field
    if condition == "tensorParallelism":
        return p.tensor > 1, "parallelism.tensor", p.tensor, f"parallelism.tensor {p.tensor}"
    if condition == "pipelineParallelism":
        size = p.pipeline
        return size > 1, "parallelism.pipeline", size, f"parallelism.pipeline {size}"
    if condition == "speculativeDecoding":
        return speculative is not None, "features.speculative", True, "features.speculative"
    if condition == "speculativeMethod":
        method = speculative.method if speculative is not None else None
        on = method is not None and method in (rule.methods or [])
        return on, "features.speculative.method", method, f"features.speculative.method {method}"
    if condition == "lora":
        return has_lora(spec), "engine.extraArgs", LORA_FLAG, f"engine.extraArgs {LORA_FLAG}"
    if condition == "kvCacheOffloading":
        field = "features.kvCacheOffloading"
        return spec.features.kv_cache_offloading is not None, field, True, field
    if condition == "fp8":
        # FP8 (e4m3) fields only: an int8 LM head (engine.lmHeadQuantization int8) is not FP8.
        engine = spec.engine
        if engine.quantization == "fp8":
            return True, "engine.quantization", "fp8", "engine.quantization fp8"
        if engine.lm_head_quantization == "fp8":
            return True, "engine.lmHeadQuantization", "fp8", "engine.lmHeadQuantization fp8"
        on = engine.kv_cache_dtype == "fp8"
        return on, "engine.kvCacheDtype", engine.kv_cache_dtype, "engine.kvCacheDtype fp8"
    return False, "model.source", spec.model.source, "the model"  # model: never known here


def _match(rule: RunnerRule, spec: InferenceServiceSpec, variant: str) -> Match | None:
    """The rule as a Match when planning evaluates it and it holds for `spec` on `variant`."""
    if not rule.evaluated or not rule.applies_to(variant) or rule.when is None:
        return None
    if not rule.when:  # a variant-only rule
        return Match(rule, ("engine.variant",), variant, f"the {variant} variant")
    parts = [_condition(condition, rule, spec) for condition in rule.when]
    if not all(holds for holds, _, _, _ in parts):
        return None
    fields = tuple(dict.fromkeys(field for _, field, _, _ in parts))
    return Match(rule, fields, parts[0][2], " with ".join(name for _, _, _, name in parts))


def matches(
    spec: InferenceServiceSpec, release: Release, variant: str, effect: Effect
) -> list[Match]:
    """The rules of `release` with `effect` that hold for `spec` on `variant`, in catalog order."""
    found = []
    for rule in release.runner_rules:
        if effect in rule.effects and (match := _match(rule, spec, variant)) is not None:
            found.append(match)
    return found


def condition_holds(condition: Condition, rule: RunnerRule, spec: InferenceServiceSpec) -> bool:
    """Whether one condition of `rule` holds for `spec` (`model` never does: unknown here)."""
    return _condition(condition, rule, spec)[0]
