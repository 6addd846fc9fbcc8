"""Every child object of one InferenceService, in apply order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from davit_operator.builders.budget import pod_disruption_budget
from davit_operator.builders.metadata import Owner
from davit_operator.builders.service import service, track_services
from davit_operator.planning.plan import Plan


def children(
    plan: Plan,
    owner: Owner,
    deployments: Sequence[dict[str, Any]],
    *,
    per_track_services: bool = False,
) -> list[dict[str, Any]]:
    """The Deployments (one per track, as the rollout decided them), the Service, the
    PodDisruptionBudget when more than one replica runs, and the per-track Services when an
    HTTPRoute splits the traffic."""
    built = [*deployments, service(plan, owner)]
    budget = pod_disruption_budget(plan, owner)
    if budget is not None:
        built.append(budget)
    if per_track_services:
        built += track_services(plan, owner)
    return built
