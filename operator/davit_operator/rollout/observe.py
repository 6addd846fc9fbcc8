"""What a rollout sees: the live Deployments of both tracks, reduced to what the machine reads,
and the metrics of the ready canary pods."""

from __future__ import annotations

from typing import Any

from davit_operator.builders.deployment import REVISION_ANNOTATION, REVISION_LABEL, TRACK_LABEL
from davit_operator.builders.metadata import INSTANCE_LABEL
from davit_operator.kube import KubeClient
from davit_operator.planning.plan import Plan
from davit_operator.rollout.machine import Observed
from davit_operator.rollout.metrics import Reading, read_pods
from davit_operator.status.progress import deployment_progress


def _revision(live: dict[str, Any] | None) -> str | None:
    if live is None:
        return None
    value = ((live.get("metadata") or {}).get("annotations") or {}).get(REVISION_ANNOTATION)
    return str(value) if value is not None else None


def _deadline_exceeded(live: dict[str, Any] | None) -> bool:
    for cond in ((live or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return True
    return False


def _canary_ready(live: dict[str, Any] | None) -> int:
    if live is None:
        return 0
    status = live.get("status") or {}
    if status.get("observedGeneration", 0) < (live.get("metadata") or {}).get("generation", 0):
        return 0
    if status.get("replicas", 0) > status.get("updatedReplicas", 0):
        return 0  # replicas of an earlier canary revision are still around
    return int(min(status.get("updatedReplicas", 0), status.get("readyReplicas", 0)))


def observe(
    stable: dict[str, Any] | None, canary: dict[str, Any] | None, stable_replicas: int
) -> Observed:
    done, _, _ = deployment_progress(stable, stable_replicas)
    return Observed(
        stable_done=done,
        stable_revision=_revision(stable),
        stable_deadline_exceeded=_deadline_exceeded(stable),
        canary_revision=_revision(canary),
        canary_ready=_canary_ready(canary),
    )


async def read_canary(kube: KubeClient, plan: Plan, revision: str) -> Reading:
    """Metrics of the ready canary pods of `revision`, read from each pod's address."""
    selector = f"{INSTANCE_LABEL}={plan.name},{TRACK_LABEL}=canary,{REVISION_LABEL}={revision}"
    pods = await kube.list("Pod", plan.namespace, selector)
    addresses = []
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if ready and status.get("podIP"):
            addresses.append(status["podIP"])
    return await read_pods(sorted(addresses), plan.port, plan.health.metrics)
