"""Runner selection: what the engine release itself does with the spec, from its runner rules.

With `engine.runner: auto` a two-runner release runs its default runner (V2) unless a rule
sends it to V1 (`selectsV1OnAuto`); the V1 it arrives at may still refuse (`refusedOnV1`). A
forced runner must be shipped by the release and is refused when a rule of that runner refuses
the spec; the variable or flag the release reads is set for it (planning/args.py). A
single-runner release serves the spec on that runner unless a rule refuses it. Status reports
the runner with the release's own words for why; rules that depend on the model or the platform,
which the operator cannot see, are named in the reason as what the release may still decide.
"""

from __future__ import annotations

from dataclasses import dataclass

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.base import RunnerName
from davit_operator.catalog.loader import Catalog, EngineInfo, Release
from davit_operator.catalog.rules import RunnerRule
from davit_operator.planning.errors import runner_error
from davit_operator.planning.rules import Match, condition_holds, matches

# The pod's node label that names the CPU architecture (well-known Kubernetes label).
ARCH_LABEL = "kubernetes.io/arch"


@dataclass(frozen=True)
class SelectedRunner:
    """The runner, why, whether the release deprecates it, and whether it replaced the
    release's default because of a rule."""

    name: RunnerName
    reason: str
    deprecated: bool
    is_fallback: bool = False


def _unknown_to_operator(
    spec: InferenceServiceSpec, release: Release, variant: str
) -> list[RunnerRule]:
    """`selectsV1OnAuto` rules that also depend on the model: the rest of their condition holds
    but whether the model is one of them is known only to the release."""
    found = []
    for rule in release.runner_rules:
        if "selectsV1OnAuto" not in rule.effects or rule.when is None or "model" not in rule.when:
            continue
        rest = [c for c in rule.when if c != "model"]
        if rule.applies_to(variant) and all(condition_holds(c, rule, spec) for c in rest):
            found.append(rule)
    return found


def _name(engine_type: str, release: Release) -> str:
    return f"{engine_type} {release.version}"


def _subjects(found: list[Match], spec: InferenceServiceSpec) -> str:
    return ", ".join(f"{m.subject} ({m.wording(spec)})" for m in found)


def _fields(found: list[Match]) -> str:
    return ", ".join(dict.fromkeys(field for m in found for field in m.fields))


def _notes(
    spec: InferenceServiceSpec, release: Release, variant: str, engine_type: str, auto: bool
) -> str:
    """What the release may still do that the operator cannot check, as a reason suffix."""
    notes = []
    if auto and len(release.runners) > 1:
        for rule in _unknown_to_operator(spec, release, variant):
            notes.append(
                f"{_name(engine_type, release)} may still pick V1 by itself for "
                f"{rule.note or rule.text}"
            )
    standalone = matches(spec, release, variant, "refusedOnStandaloneCpu")
    arch = spec.pod.node_selector.get(ARCH_LABEL)
    if standalone and arch != "amd64":
        notes.append(
            f"on a non-x86 CPU without Triton {_name(engine_type, release)} runs its standalone "
            f"CPU runner, which refuses {_subjects(standalone, spec)}"
            + (f"; pod.nodeSelector {ARCH_LABEL}: amd64 avoids it" if arch is None else "")
        )
    return "".join(f"; {note}" for note in notes)


@dataclass(frozen=True)
class _Refused:
    field: str
    value: object
    reason: str
    message: str


def _forced(
    spec: InferenceServiceSpec,
    engine_type: str,
    engine: EngineInfo,
    release: Release,
    variant: str,
    forced: RunnerName,
) -> SelectedRunner | _Refused:
    name, upper = _name(engine_type, release), forced.upper()
    if forced not in release.runners:
        last = engine.last_with(forced, before=release.version)
        if last is not None:
            why = (
                f"{name} no longer ships runner {upper}; {upper} was last shipped in "
                f"{last.version}: pin engine.version <= {last.version}"
            )
        else:
            why = f"{name} has no runner {upper}"
        return _Refused(
            "engine.runner",
            forced,
            "RunnerUnavailable",
            f"engine.runner {forced}: {why}, or set engine.runner: auto",
        )
    single = len(release.runners) == 1
    refusing = matches(spec, release, variant, f"refusedOn{upper}")  # type: ignore[arg-type]
    if single:
        refusing += matches(spec, release, variant, "refused")
    if refusing:
        return _Refused(
            refusing[0].fields[0],
            refusing[0].value,
            "RunnerUnsupported",
            f"engine.runner {forced}: runner {upper} of {name} refuses "
            f"{_subjects(refusing, spec)}; "
            + ("" if single else "set engine.runner: auto or ")
            + f"change {_fields(refusing)}",
        )
    switch = release.runner_switch
    if switch is not None and switch.kind == "env":
        how = f" ({switch.name}={switch.values[forced]})"
    elif switch is None:
        how = f"; {upper} is the only runner of {name}, which reads no runner switch"
    else:
        how = ""
    return SelectedRunner(
        name=forced,
        reason=f"engine.runner is {forced}{how}"
        + _notes(spec, release, variant, engine_type, auto=False),
        deprecated=forced in release.deprecated_runners,
    )


def _auto(
    spec: InferenceServiceSpec,
    engine_type: str,
    engine: EngineInfo,
    release: Release,
    variant: str,
) -> SelectedRunner | _Refused:
    name = _name(engine_type, release)
    default = release.default_runner
    notes = _notes(spec, release, variant, engine_type, auto=True)
    if len(release.runners) == 1:
        refusing = matches(spec, release, variant, "refused")
        if refusing:
            others = [r for r in ("v1", "v2") if r != default]
            last = engine.last_with(others[0], before=release.version)  # type: ignore[arg-type]
            gone = (
                f"; runner {others[0].upper()} was last shipped in {last.version}"
                if last is not None
                else ""
            )
            return _Refused(
                refusing[0].fields[0],
                refusing[0].value,
                "NoRunnerSupports",
                f"no runner of {name} serves this spec: runner {default.upper()} refuses "
                f"{_subjects(refusing, spec)}{gone}; change {_fields(refusing)}",
            )
        return SelectedRunner(
            name=default,
            reason=f"{default.upper()} is the only runner of {name}{notes}",
            deprecated=default in release.deprecated_runners,
        )
    sends = matches(spec, release, variant, "selectsV1OnAuto") if default == "v2" else []
    if not sends:
        return SelectedRunner(
            name=default,
            reason=f"{default.upper()} is the default runner of {name}{notes}",
            deprecated=default in release.deprecated_runners,
        )
    refusing = matches(spec, release, variant, "refusedOnV1")
    verb = "is" if len(sends) == 1 else "are"
    if refusing:
        return _Refused(
            refusing[0].fields[0],
            refusing[0].value,
            "NoRunnerSupports",
            f"no runner of {name} serves this spec: {_subjects(sends, spec)} {verb} not "
            f"supported by runner V2, and runner V1 refuses {_subjects(refusing, spec)}; "
            f"change {_fields(sends + refusing)}",
        )
    switch = release.runner_switch
    who = (
        "the release falls back to V1 by itself"
        if switch is not None and switch.kind == "env"
        else "falling back to V1"
    )
    deprecated = "v1" in release.deprecated_runners
    # Rules that send the release to V1 only while it decides (vLLM 0.30-0.33 and dual-batch
    # overlap): a forced V2 that nothing refuses runs it on V2.
    v2_would_serve = not matches(spec, release, variant, "refusedOnV2")
    return SelectedRunner(
        name="v1",
        reason=f"{_subjects(sends, spec)} {verb} not supported by runner V2 of {name}; {who}"
        + (" (deprecated)" if deprecated else "")
        + ("; engine.runner: v2 runs it on V2" if v2_would_serve else ""),
        deprecated=deprecated,
        is_fallback=True,
    )


def decide(
    spec: InferenceServiceSpec,
    engine_type: str,
    engine: EngineInfo,
    release: Release,
    variant: str,
) -> SelectedRunner | None:
    """The runner `release` runs `spec` with on `variant`, or None when it refuses the spec."""
    outcome = _decide(spec, engine_type, engine, release, variant)
    return outcome if isinstance(outcome, SelectedRunner) else None


def _decide(
    spec: InferenceServiceSpec,
    engine_type: str,
    engine: EngineInfo,
    release: Release,
    variant: str,
) -> SelectedRunner | _Refused:
    forced = spec.engine.runner
    if forced == "auto":
        return _auto(spec, engine_type, engine, release, variant)
    return _forced(spec, engine_type, engine, release, variant, forced)


def select_runner(spec: InferenceServiceSpec, catalog: Catalog, variant: str) -> SelectedRunner:
    """Pick the runner or raise PlanError naming the field and what would work instead."""
    engine_type = spec.engine.type
    engine = catalog.engines.engines[engine_type]
    release = engine.facts_for(spec.engine.version)
    assert release is not None, "resolve_image validates the version first"
    outcome = _decide(spec, engine_type, engine, release, variant)
    if isinstance(outcome, _Refused):
        raise runner_error(outcome.field, outcome.value, outcome.reason, outcome.message)
    return outcome
