"""The children a plan produces besides its Deployments: the Service and the budget."""

from __future__ import annotations

from typing import Any

from davit_operator.builders.budget import pod_disruption_budget
from davit_operator.builders.children import children
from davit_operator.builders.deployment import engine_deployment
from davit_operator.builders.metadata import Owner
from davit_operator.builders.service import service
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.plan import Plan, make_plan
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="0b9c5c3e-1111-2222-3333-444455556666")


def deployment(plan: Plan, owner: Owner) -> dict[str, Any]:
    """The stable track's Deployment at the plan's replica count."""
    return engine_deployment(plan, owner, "stable", plan.replicas).manifest


def test_service_and_budget() -> None:
    single = make_plan("svc", "ns", make_spec(), CATALOG)
    assert pod_disruption_budget(single, OWNER) is None
    assert [c["kind"] for c in children(single, OWNER, [deployment(single, OWNER)])] == [
        "Deployment",
        "Service",
    ]
    svc = service(single, OWNER)
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert svc["spec"]["selector"] == {"serving.davit.dev/inferenceservice": "svc"}
    many = make_plan("svc", "ns", make_spec(replicas=2), CATALOG)
    pdb = pod_disruption_budget(many, OWNER)
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1
    assert [c["kind"] for c in children(many, OWNER, [deployment(many, OWNER)])] == [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    ]
