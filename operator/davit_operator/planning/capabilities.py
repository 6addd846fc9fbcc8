"""Engine capabilities: refuse a spec the engine release itself cannot serve, before any pod.

The catalog records per release what the engine implements whichever runner runs it
(`Capabilities`: parallel sizes, expert parallelism, features, speculative methods). A spec that
asks for more would only produce pods that stop at startup, so planning refuses it naming every
field at fault, what the release allows, and the catalog releases (of this engine type or another)
that would serve the spec as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.loader import Capabilities, Catalog, Release
from davit_operator.planning.errors import PlanError
from davit_operator.planning.image import default_variant
from davit_operator.planning.rules import FEATURE_FIELDS, requested_features
from davit_operator.planning.runner import decide

REASON = "UnsupportedByEngine"


@dataclass(frozen=True)
class Shortfall:
    """One thing the spec asks for that a release does not implement: the spec field, its value,
    what is missing (`why`) and the change that avoids it (`fix`)."""

    field: str
    value: object
    why: str
    fix: str


def shortfalls(spec: InferenceServiceSpec, capabilities: Capabilities) -> list[Shortfall]:
    """What `spec` asks for beyond `capabilities`, in spec order; empty when it is served."""
    p = spec.parallelism
    found: list[Shortfall] = []
    for field, size, limit in (
        ("parallelism.tensor", p.tensor, capabilities.max_tensor_parallel),
        ("parallelism.pipeline", p.pipeline, capabilities.max_pipeline_parallel),
        ("parallelism.data", p.data, capabilities.max_data_parallel),
    ):
        if limit is not None and size > limit:
            target = f"to {limit}" if limit == 1 else f"to at most {limit}"
            found.append(
                Shortfall(
                    field,
                    size,
                    f"{field} {size} (at most {limit})",
                    f"set {field} {target} and scale out with replicas",
                )
            )
    if p.expert.enabled and not capabilities.expert_parallel:
        found.append(
            Shortfall(
                "parallelism.expert.enabled",
                True,
                "parallelism.expert.enabled (no expert parallelism)",
                "remove parallelism.expert",
            )
        )
    for feature in requested_features(spec):
        if feature in capabilities.unsupported_features:
            field = FEATURE_FIELDS[feature]
            found.append(Shortfall(field, True, field, f"remove {field}"))
    for field, value, implemented in (
        ("engine.quantization", spec.engine.quantization, capabilities.quantization),
        ("engine.kvCacheDtype", spec.engine.kv_cache_dtype, capabilities.kv_cache_dtypes),
        (
            "engine.lmHeadQuantization",
            spec.engine.lm_head_quantization,
            capabilities.lm_head_quantization,
        ),
    ):
        if value not in (None, "auto") and implemented is not None and value not in implemented:
            found.append(Shortfall(field, value, f"{field} {value}", f"remove {field}"))
    speculative = spec.features.speculative
    methods = capabilities.speculative_methods
    if speculative is not None and methods is not None and speculative.method not in methods:
        found.append(
            Shortfall(
                "features.speculative.method",
                speculative.method,
                f"features.speculative.method {speculative.method} (speculative methods: "
                f"{', '.join(methods) or 'none'})",
                (f"use features.speculative.method {' or '.join(methods)} or " if methods else "")
                + "remove features.speculative",
            )
        )
    return found


def _serves(
    spec: InferenceServiceSpec, catalog: Catalog, engine_type: str, release: Release
) -> bool:
    """Whether `release` of `engine` implements the spec and runs it on the spec's variant (with
    the runner the spec asks for, or the one the release picks)."""
    if shortfalls(spec, release.capabilities):
        return False
    engine = catalog.engines.engines[engine_type]  # type: ignore[index]
    variant = default_variant(spec, catalog)
    return decide(spec, engine_type, engine, release, variant) is not None


def _versions(known: list[str], serving: list[str]) -> str:
    """`serving` (a subset of `known`, both ascending) as a short engine.version condition."""
    start = known.index(serving[0])
    contiguous = known[start : start + len(serving)] == serving
    if contiguous and serving[-1] == known[-1]:
        return f"engine.version >= {serving[0]}"
    if contiguous and len(serving) > 1:
        return f"engine.version {serving[0]} to {serving[-1]}"
    return f"engine.version {' or '.join(serving)}"


def alternatives(spec: InferenceServiceSpec, catalog: Catalog) -> list[str]:
    """Other catalog releases that serve `spec` unchanged, grouped per engine type: this engine
    type first (`engine.version ...`), then the others (`engine.type: T and engine.version ...`)."""
    current = spec.engine.type
    types = [current] + [t for t in catalog.engines.engines if t != current]
    found: list[str] = []
    for engine_type in types:
        engine = catalog.engines.engines[engine_type]
        serving = [
            r.version
            for r in engine.releases
            if not (engine_type == current and r.version == spec.engine.version)
            and _serves(spec, catalog, engine_type, r)
        ]
        if not serving:
            continue
        versions = _versions(engine.versions, serving)
        found.append(
            versions if engine_type == current else f"engine.type: {engine_type} and {versions}"
        )
    return found


def _release(spec: InferenceServiceSpec, catalog: Catalog) -> Release:
    release = catalog.engines.engines[spec.engine.type].facts_for(spec.engine.version)
    assert release is not None, "resolve_image validates the version first"
    return release


def check_capabilities(spec: InferenceServiceSpec, catalog: Catalog) -> None:
    """Raise PlanError (reason UnsupportedByEngine) when the spec's engine release does not
    implement what the spec asks for; the message names every field, what the release allows,
    how to change the spec, and which catalog releases would serve it unchanged."""
    missing = shortfalls(spec, _release(spec, catalog).capabilities)
    if not missing:
        return
    fixes = list(dict.fromkeys(s.fix for s in missing))
    others = alternatives(spec, catalog)
    raise PlanError(
        field=missing[0].field,
        value=missing[0].value,
        reason=REASON,
        condition="",
        message=f"{spec.engine.type} {spec.engine.version} does not support "
        f"{', '.join(s.why for s in missing)}; {', '.join(fixes)}"
        + (f", or serve it with {' or '.join(others)}" if others else ""),
    )


def with_alternatives(
    refused: PlanError, spec: InferenceServiceSpec, catalog: Catalog
) -> PlanError:
    """A runner refusal (no runner of the release serves the spec) with the catalog releases that
    would serve the spec unchanged added to its message; other refusals unchanged."""
    if refused.reason not in ("NoRunnerSupports", "RunnerUnsupported"):
        return refused
    others = alternatives(spec, catalog)
    if not others:
        return refused
    return PlanError(
        field=refused.field,
        value=refused.value,
        reason=refused.reason,
        condition=refused.condition,
        message=f"{refused.message}, or serve it with {' or '.join(others)}",
    )


def tensor_limit(spec: InferenceServiceSpec, catalog: Catalog) -> Callable[[int], str | None]:
    """For the memory check's advice: given a tensor-parallel size, None when the spec's release
    allows it, else a sentence saying it does not and which releases would."""
    limit = _release(spec, catalog).capabilities.max_tensor_parallel

    def explain(tensor: int) -> str | None:
        if limit is None or tensor <= limit:
            return None
        wider = spec.model_copy(
            update={"parallelism": spec.parallelism.model_copy(update={"tensor": tensor})}
        )
        others = alternatives(wider, catalog)
        return (
            f"{spec.engine.type} {spec.engine.version} supports at most parallelism.tensor "
            f"{limit}" + (f"; serve it with {' or '.join(others)}" if others else "")
        )

    return explain
