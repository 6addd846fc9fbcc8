"""The Services in front of the replicas: one for both tracks, and one per track for an
HTTPRoute that splits the traffic by weight."""

from __future__ import annotations

from typing import Any

from davit_operator.builders.deployment import TRACK_LABEL, TRACKS
from davit_operator.builders.metadata import (
    MANAGED_BY,
    Owner,
    object_metadata,
    owner_reference,
    selector_labels,
)
from davit_operator.planning.plan import Plan


def _http_port(plan: Plan) -> dict[str, Any]:
    return {"name": "http", "port": plan.port, "targetPort": "http", "protocol": "TCP"}


def service(plan: Plan, owner: Owner) -> dict[str, Any]:
    """ClusterIP Service in front of the replicas of both tracks (port 8000, named http)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(plan, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(plan.name),
            "ports": [_http_port(plan)],
        },
    }


def track_service_name(name: str, track: str) -> str:
    return f"{name}-{track}"


def track_services(plan: Plan, owner: Owner) -> list[dict[str, Any]]:
    """ClusterIP Services NAME-stable and NAME-canary, one per track."""
    built: list[dict[str, Any]] = []
    for track in TRACKS:
        selector: dict[str, str] = {**selector_labels(plan.name), TRACK_LABEL: track}
        labels: dict[str, str] = {"app.kubernetes.io/managed-by": MANAGED_BY, **selector}
        built.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": track_service_name(plan.name, track),
                    "namespace": plan.namespace,
                    "labels": labels,
                    "ownerReferences": [owner_reference(owner)],
                },
                "spec": {"type": "ClusterIP", "selector": selector, "ports": [_http_port(plan)]},
            }
        )
    return built
