"""Every child object of one InferenceService, in apply order."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from davit_operator.builders.autoscaler import horizontal_pod_autoscaler
from davit_operator.builders.budget import pod_disruption_budget
from davit_operator.builders.metadata import Owner
from davit_operator.builders.routing import http_route, inference_pool
from davit_operator.builders.service import service, track_services
from davit_operator.planning.plan import Plan


def children(
    plan: Plan,
    owner: Owner,
    deployments: Sequence[dict[str, Any]],
    *,
    per_track_services: bool = False,
    served: Collection[str] = (),
) -> list[dict[str, Any]]:
    """The Deployments (one per track, as the rollout decided them), the Service, the
    PodDisruptionBudget when more than one replica runs, the per-track Services when an
    HTTPRoute splits the traffic, the HorizontalPodAutoscaler of spec.autoscaling, and the
    InferencePool (and HTTPRoute) of spec.routing where the API server serves those kinds
    (`served` names the kinds it does)."""
    built = [*deployments, service(plan, owner)]
    budget = pod_disruption_budget(plan, owner)
    if budget is not None:
        built.append(budget)
    if per_track_services:
        built += track_services(plan, owner)
    autoscaling = plan.spec.autoscaling
    if autoscaling is not None:
        built.append(horizontal_pod_autoscaler(plan, owner, autoscaling))
    pool = plan.spec.routing.inference_pool
    if pool is not None and "InferencePool" in served:
        built.append(inference_pool(plan, owner, pool))
        route = http_route(plan, owner, pool)
        if route is not None and "HTTPRoute" in served:
            built.append(route)
    return built
