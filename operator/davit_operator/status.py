"""Status computation (pure): plan or refusal + observed Deployment -> the status to write.

Conditions keep their `lastTransitionTime` while their status is unchanged, so computing the
status twice from the same observations yields the same dict and the operator writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from davit_operator.api.status import (
    IMAGE_RESOLVED,
    MEMORY_PLANNED,
    READY,
    RECONCILING,
    RUNNER_SELECTED,
    SCHEDULABLE,
    STALLED,
)
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import Plan

CONDITION_ORDER = (
    READY,
    RECONCILING,
    STALLED,
    IMAGE_RESOLVED,
    RUNNER_SELECTED,
    SCHEDULABLE,
    MEMORY_PLANNED,
)


@dataclass(frozen=True)
class Cond:
    type: str
    status: str
    reason: str
    message: str


def deployment_progress(deployment: dict[str, Any] | None, replicas: int) -> tuple[bool, str, str]:
    """(done, reason, message) for an observed Deployment."""
    if deployment is None:
        return False, "Creating", "the Deployment does not exist yet"
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation", 0)
    if status.get("observedGeneration", 0) < generation:
        return False, "RolloutPending", "the Deployment controller has not seen the new template"
    updated = status.get("updatedReplicas", 0)
    ready = status.get("readyReplicas", 0)
    total = status.get("replicas", 0)
    available = status.get("availableReplicas", 0)
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "Progressing"
            and cond.get("status") == "False"
            and cond.get("reason") == "ProgressDeadlineExceeded"
        ):
            return False, "ProgressDeadlineExceeded", cond.get("message", "")
    if updated < replicas:
        return False, "RollingOut", f"{updated}/{replicas} replicas run the current template"
    if total > replicas:
        return False, "RollingOut", f"{total - replicas} old replicas are terminating"
    if ready < replicas or available < replicas:
        return False, "WaitingForReplicas", f"{ready}/{replicas} replicas are ready"
    return True, "ReplicasReady", f"{ready}/{replicas} replicas are ready"


def conditions_for(
    plan: Plan | None, error: PlanError | None, deployment: dict[str, Any] | None
) -> list[Cond]:
    """The full set of conditions for one observation."""
    if error is not None:
        conds = [
            Cond(READY, "False", error.reason, error.message),
            Cond(RECONCILING, "False", error.reason, "waiting for the spec to change"),
            Cond(STALLED, "True", error.reason, error.message),
        ]
        if error.condition == IMAGE_RESOLVED:
            conds.append(Cond(IMAGE_RESOLVED, "False", error.reason, error.message))
        elif error.condition == RUNNER_SELECTED:
            conds.append(Cond(IMAGE_RESOLVED, "True", "Resolved", "the image resolved"))
            conds.append(Cond(RUNNER_SELECTED, "False", error.reason, error.message))
        return conds
    assert plan is not None
    image = plan.image
    conds = [
        Cond(
            IMAGE_RESOLVED,
            "True",
            "Pinned" if image.pinned else "Unpinned",
            f"{image.reference} ({image.engine_type} {image.engine_version}, {image.variant}, "
            f"from {image.source}{', no digest recorded' if not image.pinned else ''})",
        ),
        Cond(
            RUNNER_SELECTED,
            "True",
            "Fallback" if plan.runner.is_fallback else "Selected",
            f"{plan.runner.name.upper()}: {plan.runner.reason}",
        ),
    ]
    if plan.fit.fits is False:
        conds.append(Cond(SCHEDULABLE, "False", "NoNodeFits", plan.fit.message))
        return [
            Cond(READY, "False", "NoNodeFits", plan.fit.message),
            Cond(RECONCILING, "False", "NoNodeFits", "waiting for the spec or the nodes to change"),
            Cond(STALLED, "True", "NoNodeFits", plan.fit.message),
            *conds,
        ]
    if plan.fit.fits is True:
        conds.append(Cond(SCHEDULABLE, "True", "NodeFits", plan.fit.message))
    if plan.memory is not None:
        profiling = plan.memory.source == "pending"
        conds.append(
            Cond(
                MEMORY_PLANNED,
                "False" if profiling else "True",
                "Profiling" if profiling else plan.memory.source.capitalize(),
                plan.memory.message,
            )
        )
    done, reason, message = deployment_progress(deployment, plan.replicas)
    if plan.memory is not None and plan.memory.source == "pending" and deployment is None:
        # Replicas wait for the profile; say so instead of "does not exist yet".
        reason, message = "ProfilingMemory", plan.memory.message
    if done:
        head = [
            Cond(READY, "True", reason, message),
            Cond(RECONCILING, "False", reason, ""),
            Cond(STALLED, "False", reason, ""),
        ]
    elif reason == "ProgressDeadlineExceeded":
        head = [
            Cond(READY, "False", reason, message),
            Cond(RECONCILING, "False", reason, ""),
            Cond(STALLED, "True", reason, message),
        ]
    else:
        head = [
            Cond(READY, "False", reason, message),
            Cond(RECONCILING, "True", reason, message),
            Cond(STALLED, "False", reason, ""),
        ]
    return head + conds


def merge_conditions(
    new: list[Cond], old: list[dict[str, Any]], generation: int, now: str
) -> list[dict[str, Any]]:
    """Conditions as status dicts; lastTransitionTime kept while a condition's status holds."""
    previous = {c.get("type"): c for c in old}
    merged = []
    for cond in sorted(new, key=lambda c: CONDITION_ORDER.index(c.type)):
        before = previous.get(cond.type)
        since = before.get("lastTransitionTime") if before else None
        if not before or before.get("status") != cond.status or not since:
            since = now
        merged.append(
            {
                "type": cond.type,
                "status": cond.status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": since,
                "observedGeneration": generation,
            }
        )
    return merged


def compute_status(
    *,
    plan: Plan | None,
    error: PlanError | None,
    deployment: dict[str, Any] | None,
    old_status: dict[str, Any],
    generation: int,
    now: str,
) -> dict[str, Any]:
    """The complete status owned by the operator (fields it does not set are None)."""
    conds = conditions_for(plan, error, deployment)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": merge_conditions(conds, old_status.get("conditions") or [], generation, now),
        "artifact": None,
        "runner": None,
        "memoryPlan": None,
        "engine": None,
        "accelerator": None,
        "engineArgs": None,
        "desiredReplicas": None,
        "readyReplicas": None,
        "updatedReplicas": None,
        "replicaSummary": None,
        "url": None,
    }
    if plan is None:
        # Keep describing what the replicas still run; the conditions say why nothing changes.
        return {k: v for k, v in status.items() if k in ("observedGeneration", "conditions")}
    image = plan.image
    observed = (deployment or {}).get("status") or {}
    ready = int(observed.get("readyReplicas", 0))
    status.update(
        {
            "artifact": {
                "image": image.reference,
                "repository": image.repository,
                "tag": image.tag,
                "digest": image.digest,
                "pinned": image.pinned,
                "engineType": image.engine_type,
                "engineVersion": image.engine_version,
                "releaseTitle": image.release_title,
                "variant": image.variant,
                "catalogVersion": image.catalog_version,
                "source": image.source,
            },
            "runner": {"name": plan.runner.name, "reason": plan.runner.reason},
            "memoryPlan": plan.memory.to_status() if plan.memory is not None else None,
            "engine": f"{image.engine_type} {image.tag or image.engine_version}",
            "accelerator": plan.placement.summary,
            "engineArgs": [*plan.invocation.command, *plan.invocation.args],
            "desiredReplicas": plan.replicas,
            "readyReplicas": ready,
            "updatedReplicas": int(observed.get("updatedReplicas", 0)),
            "replicaSummary": f"{ready}/{plan.replicas}",
            "url": plan.service_url,
        }
    )
    return status


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys whose value changed (None deletes); empty when nothing changed."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        current = old.get(key)
        if value is None and current is None:
            continue
        if _strip_none(current) != _strip_none(value):
            patch[key] = value
    return patch


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value
