"""The scaling and routing parts of the status: `status.replicas` and `status.selector` (what
the scale subresource serves to an autoscaler), and the Routed condition of spec.routing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from davit_operator.api.status import InferenceServiceStatus
from davit_operator.status.conditions import ConditionState, set_conditions

ROUTED = "Routed"
INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io (v1)"
HTTP_ROUTE_CRD = "httproutes.gateway.networking.k8s.io (v1)"


@dataclass(frozen=True)
class Routing:
    """What spec.routing asked for and which of those kinds the API server serves."""

    name: str
    picker: str  # the endpoint picker Service, NAME:PORT
    gateway: str | None  # the HTTPRoute's Gateway, when a route is asked for
    pool_served: bool
    route_served: bool


def routed_condition(routing: Routing) -> ConditionState:
    """Routed: True once the InferencePool (and the HTTPRoute asked for) can exist; False,
    naming the CRDs to install, where the API server does not serve them."""
    missing = [INFERENCE_POOL_CRD] if not routing.pool_served else []
    if routing.gateway is not None and not routing.route_served:
        missing.append(HTTP_ROUTE_CRD)
    if missing:
        return ConditionState(
            ROUTED,
            "False",
            "RoutingAPIMissing",
            f"the API server does not serve {' and '.join(missing)}: install the Gateway API "
            "(and Inference Extension) CRDs; the operator creates the objects within a minute "
            f"of their installation, and the engines answer through Service {routing.name} "
            "meanwhile",
        )
    message = (
        f"InferencePool {routing.name} selects the engine pods (endpoint picker {routing.picker})"
    )
    if routing.gateway is not None:
        message += f"; HTTPRoute {routing.name} attaches it to Gateway {routing.gateway}"
    return ConditionState(ROUTED, "True", "InferencePoolCreated", message)


def with_scaling(
    status: InferenceServiceStatus,
    *,
    selector: str,
    replicas: int,
    routing: Routing | None,
    written: Mapping[str, Any],
    generation: int,
    now: str,
) -> InferenceServiceStatus:
    """`status` with the replicas and selector the scale subresource reads and, when
    spec.routing asks for an InferencePool, the Routed condition."""
    update: dict[str, Any] = {"selector": selector, "replicas": replicas}
    if routing is not None:
        update["conditions"] = set_conditions(
            status.conditions,
            [routed_condition(routing)],
            written=written.get("conditions") or [],
            generation=generation,
            now=now,
        )
    return status.model_copy(update=update)
