"""Runner selection from the catalog's compatibility matrix (engine x version x feature x variant).

V2 is picked unless the release's default is V1 or a requested feature, speculative method,
variant or model needs V1; a forced choice (`engine.runner: v1|v2`) is honoured or refused. The
reason is always a sentence a user can act on.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.loader import Catalog, EngineInfo, FeatureName, Release, RunnerName
from davit_operator.planning.errors import runner_error

# Spec path of each catalog feature, for messages.
FEATURE_FIELDS: dict[FeatureName, str] = {
    "sequenceParallelism": "parallelism.sequenceParallelism",
    "dualBatchOverlap": "parallelism.dualBatchOverlap",
    "elasticExpertParallelism": "parallelism.expert.elastic",
    "customLogitsProcessors": "features.customLogitsProcessors",
}


@dataclass(frozen=True)
class SelectedRunner:
    """The runner, why, whether the release deprecates it, and whether it replaced the
    release's default because of a blocker."""

    name: RunnerName
    reason: str
    deprecated: bool
    is_fallback: bool = False


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


def model_name(spec: InferenceServiceSpec) -> str:
    """ORG/NAME or the pvc path of the model, for model-pattern rules."""
    return spec.model.source.split("://", 1)[1]


def blockers(
    spec: InferenceServiceSpec, engine: EngineInfo, runner: RunnerName, variant: str
) -> list[tuple[str, str]]:
    """(field, why) pairs that keep `runner` from serving this spec; empty when it can."""
    info = engine.runners[runner]
    found: list[tuple[str, str]] = []
    for feature in requested_features(spec):
        if feature in info.unsupported_features:
            found.append((FEATURE_FIELDS[feature], f"{FEATURE_FIELDS[feature]} is not supported"))
    speculative = spec.features.speculative
    if speculative is not None and speculative.method in info.unsupported_speculative_methods:
        found.append(
            (
                "features.speculative.method",
                f"features.speculative.method {speculative.method} is not supported",
            )
        )
    if variant not in info.variants:
        found.append(("engine.variant", f"the {variant} variant is not supported"))
    name = model_name(spec)
    for pattern in info.unsupported_models_by_variant.get(variant, []):  # type: ignore[call-overload]
        if fnmatch.fnmatch(name.lower(), pattern.lower()):
            found.append(
                ("model.source", f"model {name} on {variant} is not supported ({pattern})")
            )
    return found


def _describe(engine_type: str, release: Release, runner: RunnerName) -> str:
    return f"runner {runner.upper()} of {engine_type} {release.version}"


def select_runner(spec: InferenceServiceSpec, catalog: Catalog, variant: str) -> SelectedRunner:
    """Pick the runner or raise PlanError naming the field and what would work instead."""
    engine_type = spec.engine.type
    engine = catalog.engines.engines[engine_type]
    release = engine.release(spec.engine.version)
    assert release is not None, "resolve_image validates the version first"

    def removal_hint(runner: RunnerName) -> str:
        removed = engine.first_without(runner)
        last = engine.last_with(runner, before=release.version)
        if removed is not None and last is not None:
            return (
                f"runner {runner.upper()} was removed in {engine_type} {removed.version}; pin "
                f"engine.version <= {last.version}"
            )
        return f"{engine_type} {release.version} has no runner {runner.upper()}"

    forced = spec.engine.runner
    if forced != "auto":
        if forced not in release.runners:
            raise runner_error(
                "engine.runner",
                forced,
                "RunnerUnavailable",
                f"engine.runner {forced}: {removal_hint(forced)}, or set engine.runner: auto",
            )
        problems = blockers(spec, engine, forced, variant)
        if problems:
            raise runner_error(
                problems[0][0],
                forced,
                "RunnerUnsupported",
                f"engine.runner {forced}: {'; '.join(why for _, why in problems)} by "
                f"{_describe(engine_type, release, forced)}; set engine.runner: auto or change "
                f"{', '.join(sorted({field for field, _ in problems}))}",
            )
        return SelectedRunner(
            name=forced,
            reason=f"engine.runner is {forced}",
            deprecated=forced in release.deprecated_runners,
        )

    ordered: list[RunnerName] = [release.default_runner] + [
        r for r in release.runners if r != release.default_runner
    ]
    default_problems = blockers(spec, engine, release.default_runner, variant)
    if not default_problems:
        return SelectedRunner(
            name=release.default_runner,
            reason=f"{release.default_runner.upper()} is the default runner of {engine_type} "
            f"{release.version}",
            deprecated=release.default_runner in release.deprecated_runners,
        )
    because = "; ".join(why for _, why in default_problems)
    for runner in ordered[1:]:
        if not blockers(spec, engine, runner, variant):
            deprecated = runner in release.deprecated_runners
            return SelectedRunner(
                name=runner,
                reason=f"{because} by runner {release.default_runner.upper()}; falling back to "
                f"{runner.upper()}" + (" (deprecated)" if deprecated else ""),
                deprecated=deprecated,
                is_fallback=True,
            )
    fields = sorted({field for field, _ in default_problems})
    missing = [r for r in ("v1", "v2") if r not in release.runners]
    hint = "; ".join(removal_hint(r) for r in missing)  # type: ignore[arg-type]
    raise runner_error(
        fields[0],
        spec.engine.version,
        "NoRunnerSupports",
        f"no runner of {engine_type} {release.version} serves this spec: {because} by runner "
        f"{release.default_runner.upper()}"
        + (f"; {hint}" if hint else "")
        + f"; or remove {', '.join(fields)}",
    )
