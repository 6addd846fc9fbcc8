"""The PodDisruptionBudget of the replicas."""

from __future__ import annotations

from typing import Any

from davit_operator.builders.metadata import Owner, object_metadata, selector_labels
from davit_operator.planning.plan import Plan


def pod_disruption_budget(plan: Plan, owner: Owner) -> dict[str, Any] | None:
    """At most one voluntary disruption at a time; None for a single replica, where a budget
    would only block node drains."""
    if plan.replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_metadata(plan, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(plan.name)}},
    }
