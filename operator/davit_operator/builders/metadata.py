"""What every child object carries: the owner reference (garbage collection when the
InferenceService goes), the common labels, and the selector labels of the replicas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from davit_operator.api.identity import API_VERSION, GROUP, KIND
from davit_operator.planning.plan import Plan

MANAGED_BY = "davit-operator"
INSTANCE_LABEL = f"{GROUP}/inferenceservice"


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


def object_metadata(plan: Plan, owner: Owner) -> dict[str, Any]:
    """Name, namespace, common labels and owner of a child named after the service."""
    return {
        "name": plan.name,
        "namespace": plan.namespace,
        "labels": common_labels(plan),
        "ownerReferences": [owner_reference(owner)],
    }
