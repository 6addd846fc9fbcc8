"""How far an observed Deployment is: every replica on the current template and ready, or not
yet and why."""

from __future__ import annotations

from typing import Any


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
