"""The InferencePool of `spec.routing.inferencePool` and its optional HTTPRoute.

The pool selects the engine pods of both rollout tracks (the instance label), so during a
canary the endpoint picker chooses among stable and canary pods alike and the traffic follows
the replica ratio, as it does through the Service.
"""

from __future__ import annotations

from typing import Any

from davit_operator.api.routing import InferencePoolSpec
from davit_operator.builders.metadata import Owner, object_metadata, selector_labels
from davit_operator.planning.plan import Plan

INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION = f"{INFERENCE_POOL_GROUP}/v1"
GATEWAY_GROUP = "gateway.networking.k8s.io"
HTTP_ROUTE_VERSION = f"{GATEWAY_GROUP}/v1"


def inference_pool(plan: Plan, owner: Owner, pool: InferencePoolSpec) -> dict[str, Any]:
    """InferencePool NAME: the service's engine pods on the engine port, and its picker."""
    picker = pool.endpoint_picker_ref
    return {
        "apiVersion": INFERENCE_POOL_VERSION,
        "kind": "InferencePool",
        "metadata": object_metadata(plan, owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(plan.name)},
            "targetPorts": [{"number": plan.port}],
            # Spelled out as the API server defaults them, so a reread compares equal.
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }


def http_route(plan: Plan, owner: Owner, pool: InferencePoolSpec) -> dict[str, Any] | None:
    """HTTPRoute NAME from the spec's Gateway to the pool, or None when none is asked for."""
    route = pool.http_route
    if route is None:
        return None
    parent: dict[str, Any] = {
        "group": GATEWAY_GROUP,
        "kind": "Gateway",
        "name": route.parent_ref.name,
    }
    if route.parent_ref.namespace is not None:
        parent["namespace"] = route.parent_ref.namespace
    if route.parent_ref.section_name is not None:
        parent["sectionName"] = route.parent_ref.section_name
    return {
        "apiVersion": HTTP_ROUTE_VERSION,
        "kind": "HTTPRoute",
        "metadata": object_metadata(plan, owner),
        "spec": {
            "parentRefs": [parent],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": route.path_prefix}}],
                    "backendRefs": [
                        {
                            "group": INFERENCE_POOL_GROUP,
                            "kind": "InferencePool",
                            "name": plan.name,
                            "weight": 1,
                        }
                    ],
                }
            ],
        },
    }
