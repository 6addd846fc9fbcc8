"""Pure builders: Plan -> Kubernetes objects as plain, deterministic dicts.

Every object carries the owner reference (garbage collection when the InferenceService goes),
the common labels, and only fields the operator means to own: server-side apply makes the
operator the manager of exactly these fields, and drift detection compares exactly these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from davit_operator.api.identity import API_VERSION, GROUP, KIND
from davit_operator.planning.args import MODEL_CACHE_DIR
from davit_operator.planning.plan import Plan

MANAGED_BY = "davit-operator"
INSTANCE_LABEL = f"{GROUP}/inferenceservice"
STARTUP_FAILURE_THRESHOLD = 180  # x 10 s: half an hour to download and load large weights
PRESTOP_SLEEP_SECONDS = 5  # longer than endpoint propagation, short against a drain
EXIT_MARGIN_SECONDS = 10  # engine shutdown after the drain (core process, sockets)


def termination_grace_seconds(drain_seconds: int) -> int:
    """Grace period covering the pre-stop delay, the engine's drain and its exit."""
    return PRESTOP_SLEEP_SECONDS + drain_seconds + EXIT_MARGIN_SECONDS


@dataclass(frozen=True)
class Owner:
    """The InferenceService that owns the children."""

    name: str
    uid: str


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select the replicas; immutable for the life of the Deployment."""
    return {INSTANCE_LABEL: name}


def common_labels(plan: Plan) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "davit-engine",
        "app.kubernetes.io/instance": plan.name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        f"{GROUP}/engine": plan.image.engine_type,
        **selector_labels(plan.name),
    }


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(plan: Plan, owner: Owner) -> dict[str, Any]:
    return {
        "name": plan.name,
        "namespace": plan.namespace,
        "labels": common_labels(plan),
        "ownerReferences": [owner_reference(owner)],
    }


def _probe(path: str, period: int, failure_threshold: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }


def engine_volume_mounts(plan: Plan) -> list[dict[str, Any]]:
    """The engine container's mounts: model cache, shared memory, read-only model volumes."""
    mounts: list[dict[str, Any]] = [
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    mounts += [
        {"name": m.volume_name, "mountPath": m.mount_path, "readOnly": True}
        for m in plan.invocation.model_mounts
    ]
    return mounts


def engine_volumes(plan: Plan) -> list[dict[str, Any]]:
    """The pod volumes behind `engine_volume_mounts`."""
    volumes: list[dict[str, Any]] = [
        {"name": "model-cache", "emptyDir": {}},
        # Tensor-parallel workers exchange tensors through shared memory.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    volumes += [
        {
            "name": m.volume_name,
            "persistentVolumeClaim": {"claimName": m.claim_name, "readOnly": True},
        }
        for m in plan.invocation.model_mounts
    ]
    return volumes


def _container(plan: Plan) -> dict[str, Any]:
    mounts = engine_volume_mounts(plan)
    return {
        "name": "engine",
        "image": plan.image.reference,
        "command": plan.invocation.command,
        "args": plan.invocation.args,
        "env": plan.invocation.env,
        "ports": [{"name": "http", "containerPort": plan.port, "protocol": "TCP"}],
        "resources": plan.placement.resources,
        "readinessProbe": _probe(plan.health.readiness, 5, 3),
        "livenessProbe": _probe(plan.health.liveness, 10, 6),
        "startupProbe": _probe(plan.health.liveness, 10, STARTUP_FAILURE_THRESHOLD),
        "volumeMounts": mounts,
        # Let endpoints drop the pod before SIGTERM starts the engine's drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
    }


def deployment(plan: Plan, owner: Owner) -> dict[str, Any]:
    """The engine Deployment."""
    volumes = engine_volumes(plan)
    pod_spec: dict[str, Any] = {
        "containers": [_container(plan)],
        "volumes": volumes,
        # Engines drain in-flight requests on SIGTERM: pre-stop delay + drain + exit margin.
        "terminationGracePeriodSeconds": termination_grace_seconds(plan.spec.rollout.drain_seconds),
    }
    if plan.placement.node_selector:
        pod_spec["nodeSelector"] = plan.placement.node_selector
    if plan.placement.tolerations:
        pod_spec["tolerations"] = plan.placement.tolerations
    if plan.placement.affinity:
        pod_spec["affinity"] = plan.placement.affinity
    if plan.spec.pod.service_account_name:
        pod_spec["serviceAccountName"] = plan.spec.pod.service_account_name
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(plan, owner),
        "spec": {
            "replicas": plan.replicas,
            "selector": {"matchLabels": selector_labels(plan.name)},
            # Accelerators are scarce: by default no extra replica starts during a rollout.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": plan.spec.rollout.rolling.max_surge,
                    "maxUnavailable": plan.spec.rollout.rolling.max_unavailable,
                },
            },
            "progressDeadlineSeconds": plan.spec.rollout.progress_deadline_seconds,
            "template": {"metadata": {"labels": common_labels(plan)}, "spec": pod_spec},
        },
    }


def service(plan: Plan, owner: Owner) -> dict[str, Any]:
    """ClusterIP Service in front of the replicas (port 8000, named http)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(plan, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(plan.name),
            "ports": [{"name": "http", "port": plan.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(plan: Plan, owner: Owner) -> dict[str, Any] | None:
    """At most one voluntary disruption at a time; None for a single replica, where a budget
    would only block node drains."""
    if plan.replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(plan, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(plan.name)}},
    }


def children(plan: Plan, owner: Owner) -> list[dict[str, Any]]:
    """Every child the plan wants, in apply order."""
    built = [deployment(plan, owner), service(plan, owner)]
    pdb = pod_disruption_budget(plan, owner)
    if pdb is not None:
        built.append(pdb)
    return built
