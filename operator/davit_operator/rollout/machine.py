"""The rollout state machine (pure): where a spec change stands and what the replicas should be.

Level-based like the rest of the operator: every reconcile passes the target revision, the
rollout status written last time, the live Deployments and the latest canary reading, and gets
back the complete decision (which revision each Deployment runs with how many replicas, the
status to write, the events to post). The same inputs give the same decision; time enters only
as the `now` argument.

States (`status.rollout.phase`):
- Complete: the stable revision is the target; nothing moves.
- Progressing: the target's replicas are coming up (Rolling: the Deployment controller replaces
  them; Canary: step `step` of the canary holds, then the analysis may advance it).
- Paused: `spec.rollout.paused`; nothing advances and no deadline runs.
- Promoting: the canary passed every step; the stable Deployment takes the new revision.
- RolledBack: the target failed (deadline or analysis) and the stable revision serves again;
  it stays so until the spec changes.
- Failed: as RolledBack, but `autoRollback: false` or no earlier good revision: the target
  stays where it stopped for a person to decide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from davit_operator.api.rollout import MAX_REVISIONS, RolloutSpec
from davit_operator.api.status import ConditionStatus
from davit_operator.rollout.metrics import Reading

NORMAL, WARNING = "Normal", "Warning"


@dataclass(frozen=True)
class Target:
    """The revision the spec asks for, as the status records it."""

    revision: str
    spec_json: str
    image: str
    digest: str | None
    engine_args: tuple[str, ...]


@dataclass(frozen=True)
class Observed:
    """Live Deployments, reduced to what the machine reads."""

    stable_done: bool  # the stable Deployment runs `stable_revision` on all its replicas, ready
    stable_revision: str | None  # revision label of the live stable Deployment's template
    stable_deadline_exceeded: bool
    canary_revision: str | None  # None when no canary Deployment exists
    canary_ready: int  # ready canary replicas running canary_revision


@dataclass(frozen=True)
class Decision:
    """What the reconcile applies and writes."""

    stable_spec_json: str  # spec the stable Deployment is built from
    stable_replicas: int
    stable_paused: bool
    canary_replicas: int  # 0: no canary Deployment
    rollout: dict[str, Any]
    revisions: list[dict[str, Any]]
    condition: tuple[ConditionStatus, str, str]  # RolloutProgressing (status, reason, message)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    settled: bool = True  # False while the rollout still needs reconciles to advance
    failed: str | None = None  # reason, when the target failed and did not become stable


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def canary_split(replicas: int, weight: int) -> tuple[int, int]:
    """(canary, stable) replicas for a traffic weight: at least one canary replica, and the
    stable side gives up only whole replicas (1 replica at 50% runs 1 + 1)."""
    if weight >= 100:
        return max(replicas, 1), 0
    canary = max(1, math.ceil(replicas * weight / 100))
    stable = replicas - math.floor(replicas * weight / 100)
    return canary, stable


def _record(target: Target, strategy: str, now: float) -> dict[str, Any]:
    return {
        "revision": target.revision,
        "image": target.image,
        "digest": target.digest,
        "engineArgs": list(target.engine_args),
        "strategy": strategy,
        "startedAt": iso(now),
        "outcome": "Progressing",
        "reason": "Started",
        "message": "",
    }


def _close(
    revisions: list[dict[str, Any]],
    revision: str,
    outcome: str,
    reason: str,
    message: str,
    now: float,
) -> list[dict[str, Any]]:
    """Revisions with the open record of `revision` ended (the newest such record)."""
    out = [dict(r) for r in revisions]
    for record in reversed(out):
        if record["revision"] == revision and record["outcome"] == "Progressing":
            record.update(outcome=outcome, reason=reason, message=message, finishedAt=iso(now))
            break
    return out


def _open(revisions: list[dict[str, Any]], record: dict[str, Any], now: float) -> list[Any]:
    out = []
    for r in revisions:
        r = dict(r)
        if r["outcome"] == "Progressing":
            r.update(
                outcome="Superseded",
                reason="SpecChanged",
                message=f"the spec moved on to revision {record['revision']}",
                finishedAt=iso(now),
            )
        out.append(r)
    out.append(record)
    return out[-MAX_REVISIONS:]


@dataclass(frozen=True)
class Inputs:
    spec: RolloutSpec
    replicas: int
    target: Target
    old: dict[str, Any]  # status.rollout as written last time ({} when none)
    revisions: list[dict[str, Any]]
    observed: Observed
    reading: Reading | None  # canary metrics, when a canary exists and was read
    now: float


def decide(inp: Inputs) -> Decision:
    """The complete rollout decision for one observation (see module docstring)."""
    old, target, spec = inp.old, inp.target, inp.spec
    stable_rev = old.get("stableRevision")
    stable_json = old.get("stableSpec")
    if stable_rev is None or stable_json is None:
        return _first_revision(inp)
    if target.revision == stable_rev:
        return _steady(inp, stable_json)
    same_target = old.get("targetRevision") == target.revision
    if same_target and old.get("phase") in ("RolledBack", "Failed"):
        return _held(inp, stable_json)
    if not same_target or old.get("phase") == "Complete":
        return _start(inp, stable_json)
    if spec.strategy == "Rolling" or old.get("strategy") == "Rolling":
        return _rolling(inp, stable_json)
    return _canary(inp, stable_json)


def _base(inp: Inputs, **fields: Any) -> dict[str, Any]:
    old = inp.old
    rollout = {
        "phase": old.get("phase", "Complete"),
        "strategy": old.get("strategy", inp.spec.strategy),
        "stableRevision": old.get("stableRevision"),
        "targetRevision": inp.target.revision,
        "step": old.get("step"),
        "weight": old.get("weight"),
        "stepStartedAt": old.get("stepStartedAt"),
        "stepReadyAt": old.get("stepReadyAt"),
        "message": old.get("message", ""),
        "analysis": old.get("analysis"),
        "stableSpec": old.get("stableSpec"),
    }
    rollout.update(fields)
    return rollout


def _on_target(
    inp: Inputs,
    rollout: dict[str, Any],
    revisions: list[dict[str, Any]],
    condition: tuple[ConditionStatus, str, str],
    *,
    stable_paused: bool = False,
    canary_replicas: int = 0,
    events: list[tuple[str, str, str]] | None = None,
    settled: bool = True,
) -> Decision:
    """The stable Deployment built from the target's spec on every replica (a canary only
    while a promotion drains it)."""
    return Decision(
        stable_spec_json=inp.target.spec_json,
        stable_replicas=inp.replicas,
        stable_paused=stable_paused,
        canary_replicas=canary_replicas,
        rollout=rollout,
        revisions=revisions,
        condition=condition,
        events=events or [],
        settled=settled,
    )


def _done_fields(t: Target) -> dict[str, Any]:
    """Status fields of a rollout that ended with `t` stable."""
    return {
        "phase": "Complete",
        "stableSpec": t.spec_json,
        "step": None,
        "weight": None,
        "stepStartedAt": None,
        "stepReadyAt": None,
    }


def _became_stable(
    inp: Inputs,
    revisions: list[dict[str, Any]],
    message: str,
    *,
    settled: bool,
    **fields: Any,
) -> Decision:
    """The target just became the stable revision: status Complete, one RolloutComplete event."""
    t = inp.target
    rollout = _base(inp, **_done_fields(t), stableRevision=t.revision, message=message, **fields)
    return _on_target(
        inp,
        rollout,
        revisions,
        ("False", "Complete", message),
        events=[(NORMAL, "RolloutComplete", message)],
        settled=settled,
    )


def _first_revision(inp: Inputs) -> Decision:
    """No revision was ever good: the spec's revision is rolled out directly and becomes
    stable once ready (there is nothing to roll back to)."""
    t, obs = inp.target, inp.observed
    revisions = list(inp.revisions)
    if not any(r["revision"] == t.revision for r in revisions):
        revisions = _open(revisions, _record(t, "Rolling", inp.now), inp.now)
    if obs.stable_done and obs.stable_revision == t.revision:
        revisions = _close(revisions, t.revision, "Succeeded", "Available", "", inp.now)
        message = f"revision {t.revision} is stable"
        return _became_stable(
            inp, revisions, message, settled=True, strategy=inp.spec.strategy, analysis=None
        )
    rollout = _base(
        inp,
        phase="Progressing",
        strategy="Rolling",
        stepStartedAt=inp.old.get("stepStartedAt") or iso(inp.now),
        message=f"first revision {t.revision} is starting",
    )
    return _on_target(
        inp, rollout, revisions, ("True", "FirstRevision", rollout["message"]), settled=False
    )


def _steady(inp: Inputs, stable_json: str) -> Decision:
    """The target is the stable revision (also after a spec reverted mid-rollout)."""
    t = inp.target
    revisions, events = list(inp.revisions), []
    was_complete = inp.old.get("phase") == "Complete"
    if inp.old.get("phase") not in ("Complete", None):
        events.append((NORMAL, "RolloutAborted", f"the spec is back at revision {t.revision}"))
    for r in revisions:
        if r["outcome"] == "Progressing" and r["revision"] != t.revision:
            revisions = _close(revisions, r["revision"], "Superseded", "SpecReverted", "", inp.now)
    rollout = _base(
        inp,
        **_done_fields(t),
        analysis=inp.old.get("analysis") if was_complete else None,
        message=inp.old.get("message") if was_complete else f"revision {t.revision} is stable",
    )
    return _on_target(
        inp,
        rollout,
        revisions,
        ("False", "Complete", rollout["message"]),
        events=events,
        settled=inp.observed.canary_revision is None,
    )


def _held(inp: Inputs, stable_json: str) -> Decision:
    """The target failed earlier: keep what the failure left until the spec changes."""
    phase = inp.old["phase"]
    rolled_back = phase == "RolledBack"
    reason = "RolledBack" if rolled_back else "RolloutFailed"
    canary = 0
    stable_json_now = stable_json
    if not rolled_back:
        # Failed without rollback: the target keeps what it had (canary replicas, or the
        # stable Deployment's new template under Rolling).
        if inp.old.get("strategy") == "Canary":
            canary = canary_split(inp.replicas, int(inp.old.get("weight") or 0))[0]
        else:
            stable_json_now = inp.target.spec_json
    return Decision(
        stable_spec_json=stable_json_now,
        stable_replicas=inp.replicas
        if rolled_back or not canary
        else canary_split(inp.replicas, int(inp.old.get("weight") or 0))[1],
        stable_paused=False,
        canary_replicas=canary,
        rollout=_base(inp),
        revisions=list(inp.revisions),
        condition=("False", reason, inp.old.get("message", "")),
        failed=reason,
    )


def _start(inp: Inputs, stable_json: str) -> Decision:
    t, spec = inp.target, inp.spec
    revisions = _open(list(inp.revisions), _record(t, spec.strategy, inp.now), inp.now)
    events = [
        (
            NORMAL,
            "RolloutStarted",
            f"revision {t.revision} ({spec.strategy}) replaces {inp.old.get('stableRevision')}",
        )
    ]
    fields: dict[str, Any] = {
        "phase": "Progressing",
        "strategy": spec.strategy,
        "stepStartedAt": iso(inp.now),
        "stepReadyAt": None,
        "analysis": None,
        "step": None,
        "weight": None,
    }
    if spec.strategy == "Canary":
        assert spec.canary is not None  # CEL: Canary requires canary
        fields.update(step=0, weight=spec.canary.steps[0].weight)
    started = replace(inp, old=_base(inp, **fields), revisions=revisions)
    decision = (
        _rolling(started, stable_json)
        if spec.strategy == "Rolling"
        else _canary(started, stable_json)
    )
    return replace(decision, events=events + decision.events)


def _fail(inp: Inputs, stable_json: str, reason: str, message: str) -> Decision:
    t, spec = inp.target, inp.spec
    rollback = spec.auto_rollback
    outcome = "RolledBack" if rollback else "Progressing"
    revisions = list(inp.revisions)
    if rollback:
        revisions = _close(revisions, t.revision, outcome, reason, message, inp.now)
    else:
        for r in reversed(revisions):
            if r["revision"] == t.revision and r["outcome"] == "Progressing":
                r.update(reason=reason, message=message)
                break
    phase = "RolledBack" if rollback else "Failed"
    text = (
        f"revision {t.revision} {reason}: {message}; "
        + (
            f"rolled back to {inp.old.get('stableRevision')}"
            if rollback
            else "held where it stopped (autoRollback is off)"
        )
        + "; change the spec to try again"
    )
    rollout = _base(inp, phase=phase, message=text)
    held = _held(replace(inp, old=rollout, revisions=revisions), stable_json)
    return replace(
        held,
        events=[(WARNING, "RolledBack" if rollback else "RolloutFailed", text)],
        condition=("False", "RolledBack" if rollback else "RolloutFailed", text),
    )


def _elapsed(inp: Inputs, key: str) -> float | None:
    at = parse_iso(inp.old.get(key))
    return None if at is None else inp.now - at


def _rolling(inp: Inputs, stable_json: str) -> Decision:
    t, spec, obs = inp.target, inp.spec, inp.observed
    if spec.paused:
        rollout = _base(
            inp, phase="Paused", stepStartedAt=iso(inp.now), message="paused by spec.rollout"
        )
        return _on_target(
            inp,
            rollout,
            list(inp.revisions),
            ("Unknown", "Paused", "spec.rollout.paused is true"),
            stable_paused=True,
            events=[] if inp.old.get("phase") == "Paused" else [(NORMAL, "Paused", "rollout")],
        )
    if obs.stable_revision == t.revision and obs.stable_done:
        return _complete(inp)
    elapsed = _elapsed(inp, "stepStartedAt") or 0.0
    if obs.stable_deadline_exceeded or elapsed > spec.progress_deadline_seconds:
        return _fail(
            inp,
            stable_json,
            "ProgressDeadlineExceeded",
            f"its replicas were not ready within {spec.progress_deadline_seconds} s",
        )
    rollout = _base(
        inp,
        phase="Progressing",
        message=f"the Deployment is replacing replicas with revision {t.revision}",
    )
    return _on_target(
        inp,
        rollout,
        list(inp.revisions),
        ("True", "RollingUpdate", rollout["message"]),
        events=[(NORMAL, "Resumed", "rollout")] if inp.old.get("phase") == "Paused" else [],
        settled=False,
    )


def _complete(inp: Inputs) -> Decision:
    t = inp.target
    revisions = _close(
        list(inp.revisions), t.revision, "Succeeded", "Promoted", "all replicas ready", inp.now
    )
    message = f"revision {t.revision} is stable (was {inp.old.get('stableRevision')})"
    # settled=False: one more pass removes the canary Deployment
    return _became_stable(inp, revisions, message, settled=False)


def _analysis(inp: Inputs) -> dict[str, Any] | None:
    reading = inp.reading
    if reading is None:
        return inp.old.get("analysis")
    s = reading.sample
    p95 = s.ttft_quantile(0.95)
    return {
        "requests": int(s.requests),
        "errors": int(s.errors),
        "errorRatio": None if s.error_ratio is None else round(s.error_ratio, 4),
        "ttftP95Seconds": None if p95 is None or math.isinf(p95) else p95,
        "pods": reading.pods_read,
        "at": iso(inp.now),
    }


def _canary(inp: Inputs, stable_json: str) -> Decision:
    t, spec, obs = inp.target, inp.spec, inp.observed
    assert spec.canary is not None
    steps = spec.canary.steps
    old = inp.old
    if old.get("phase") == "Promoting":
        if obs.stable_revision == t.revision and obs.stable_done:
            return _complete(inp)
        rollout = _base(inp, message=f"the stable Deployment is taking revision {t.revision}")
        return _on_target(
            inp,
            rollout,
            list(inp.revisions),
            ("True", "Promoting", rollout["message"]),
            canary_replicas=canary_split(inp.replicas, steps[-1].weight)[0],
            settled=False,
        )
    index = min(int(old.get("step") or 0), len(steps) - 1)
    step = steps[index]
    canary, stable = canary_split(inp.replicas, step.weight)
    analysis = _analysis(inp)
    # A failure below reports the reading that caused it.
    inp = replace(inp, old={**old, "analysis": analysis})
    fields: dict[str, Any] = {"step": index, "weight": step.weight, "analysis": analysis}
    events: list[tuple[str, str, str]] = []
    ready = obs.canary_revision == t.revision and obs.canary_ready >= canary
    if spec.paused:
        fields.update(phase="Paused", stepStartedAt=iso(inp.now), stepReadyAt=None)
        fields["message"] = f"paused at step {index + 1}/{len(steps)} ({step.weight}%)"
        if old.get("phase") != "Paused":
            events.append((NORMAL, "Paused", fields["message"]))
        return _canary_decision(inp, stable_json, canary, stable, fields, events, "Paused")
    if old.get("phase") == "Paused":
        events.append((NORMAL, "Resumed", f"step {index + 1}/{len(steps)}"))
    fields["phase"] = "Progressing"
    if ready and not old.get("stepReadyAt"):
        fields["stepReadyAt"] = iso(inp.now)
    ready_at = parse_iso(fields.get("stepReadyAt") or old.get("stepReadyAt"))
    started = _elapsed(inp, "stepStartedAt") or 0.0
    a = analysis or {}
    requests, ratio, p95 = a.get("requests", 0), a.get("errorRatio"), a.get("ttftP95Seconds")
    judged = ready_at is not None and requests >= spec.analysis.min_requests
    if judged and ratio is not None and ratio > spec.analysis.max_error_ratio:
        return _fail(
            inp,
            stable_json,
            "AnalysisFailed",
            f"error ratio {ratio:.3f} > {spec.analysis.max_error_ratio} over {requests} "
            f"requests at step {index + 1}/{len(steps)} ({step.weight}%)",
        )
    limit = spec.analysis.max_ttft_p95_seconds
    reading_p95 = _p95(inp, p95)
    if judged and limit is not None and reading_p95 is not None and reading_p95 > limit:
        return _fail(
            inp,
            stable_json,
            "AnalysisFailed",
            f"p95 time to first token {reading_p95:g} s > {limit} s over {requests} "
            f"requests at step {index + 1}/{len(steps)} ({step.weight}%)",
        )
    if ready_at is None and started > spec.progress_deadline_seconds:
        return _fail(
            inp,
            stable_json,
            "ProgressDeadlineExceeded",
            f"{canary} canary replica(s) were not ready within {spec.progress_deadline_seconds} s",
        )
    if (
        ready_at is not None
        and not judged
        and (started > spec.progress_deadline_seconds + step.pause_seconds)
    ):
        return _fail(
            inp,
            stable_json,
            "AnalysisInconclusive",
            f"only {requests} of the {spec.analysis.min_requests} requests needed reached the "
            f"canary within {spec.progress_deadline_seconds + step.pause_seconds} s",
        )
    if judged and ready_at is not None and inp.now - ready_at >= step.pause_seconds:
        summary = f"step {index + 1}/{len(steps)} ({step.weight}%) passed: " + _summary(a)
        events.append((NORMAL, "StepPassed", summary))
        if index + 1 < len(steps):
            nxt = steps[index + 1]
            fields.update(
                step=index + 1,
                weight=nxt.weight,
                stepStartedAt=iso(inp.now),
                stepReadyAt=None,
                message=summary,
            )
            canary, stable = canary_split(inp.replicas, nxt.weight)
            return _canary_decision(inp, stable_json, canary, stable, fields, events, "Step")
        fields.update(phase="Promoting", message=summary + "; promoting")
        events.append((NORMAL, "Promoting", f"revision {t.revision} passed every step"))
        decision = _canary_decision(inp, stable_json, canary, stable, fields, events, "Promoting")
        return replace(decision, stable_spec_json=t.spec_json, stable_replicas=inp.replicas)
    if ready_at is None:
        fields["message"] = (
            f"step {index + 1}/{len(steps)} ({step.weight}%): waiting for {canary} canary "
            f"replica(s) ({obs.canary_ready if obs.canary_revision == t.revision else 0} ready)"
        )
    else:
        fields["message"] = (
            f"step {index + 1}/{len(steps)} ({step.weight}%): analysing, " + _summary(a)
        )
    return _canary_decision(inp, stable_json, canary, stable, fields, events, "CanaryStep")


def _p95(inp: Inputs, p95: float | None) -> float | None:
    """The p95 to judge: a fresh reading's (where an overflow beyond the histogram's last
    bound counts as infinite), else the one recorded in status."""
    if inp.reading is not None:
        return inp.reading.sample.ttft_quantile(0.95)
    return p95


def _summary(a: dict[str, Any]) -> str:
    ratio = a.get("errorRatio")
    p95 = a.get("ttftP95Seconds")
    return (
        f"{a.get('requests', 0)} requests, {a.get('errors', 0)} errors"
        + (f" (ratio {ratio:.3f})" if ratio is not None else "")
        + (f", p95 TTFT <= {p95:g} s" if p95 is not None else "")
        + f" from {a.get('pods', 0)} pod(s)"
    )


def _canary_decision(
    inp: Inputs,
    stable_json: str,
    canary: int,
    stable: int,
    fields: dict[str, Any],
    events: list[tuple[str, str, str]],
    reason: str,
) -> Decision:
    rollout = _base(inp, **fields)
    status: ConditionStatus = "Unknown" if rollout["phase"] == "Paused" else "True"
    return Decision(
        stable_spec_json=stable_json,
        stable_replicas=stable,
        stable_paused=False,
        canary_replicas=canary,
        rollout=rollout,
        revisions=list(inp.revisions),
        condition=(status, reason, rollout.get("message", "")),
        events=events,
        settled=False,
    )
