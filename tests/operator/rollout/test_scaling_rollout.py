"""A canary under an autoscaler: each step's split follows the replica count the operator runs
(the autoscaler's, within its bounds), and a count change is not a new revision."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from davit_operator.builders.deployment import pod_template
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.memory import identity_hash, profile_identity
from davit_operator.planning.plan import Plan, make_plan
from davit_operator.rollout.controller import RolloutMemory, RolloutResult, plan_rollout
from davit_operator.rollout.machine import canary_split, iso
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="uid-1")
NOW = 1_800_000_000.0
CANARY = {"strategy": "Canary", "canary": {"steps": [{"weight": 25}, {"weight": 50}]}}
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 8}


def _plan(**overrides: Any) -> Plan:
    spec = make_spec(rollout=CANARY, autoscaling=AUTOSCALING, **overrides)
    return make_plan("svc", "ns", spec, CATALOG)


STABLE = _plan()
TARGET = _plan(limits={"maxNumSeqs": 8})


class NoReads:
    async def list(self, kind: str, namespace: str, label_selector: str) -> list[Any]:
        return []


def _rollout(plan: Plan, status: dict[str, Any]) -> RolloutResult:
    kube: Any = NoReads()
    return asyncio.run(
        plan_rollout(
            kube=kube,
            plan=plan,
            owner=OWNER,
            make_stable_plan=lambda spec: make_plan("svc", "ns", spec, CATALOG),
            status=status,
            live={},
            memory=RolloutMemory(),
            now=NOW,
        )
    )


def _at_step(step: int, weight: int) -> dict[str, Any]:
    return {
        "rollout": {
            "phase": "Progressing",
            "strategy": "Canary",
            "stableRevision": pod_template(STABLE).revision,
            "targetRevision": pod_template(TARGET).revision,
            "step": step,
            "weight": weight,
            "stepStartedAt": iso(NOW - 5),
            "stableSpec": STABLE.spec.model_dump_json(by_alias=True, exclude_none=True),
        },
        "revisions": [],
    }


@pytest.mark.parametrize("replicas", [1, 2, 4, 7])
def test_a_canary_step_splits_the_current_count(replicas: int) -> None:
    result = _rollout(replace(TARGET, replicas=replicas), _at_step(1, 50))
    canary, stable = canary_split(replicas, 50)
    assert (result.decision.canary_replicas, result.decision.stable_replicas) == (canary, stable)
    (stable_deployment, canary_deployment) = result.deployments
    assert stable_deployment.manifest["spec"]["replicas"] == stable
    assert canary_deployment.manifest["spec"]["replicas"] == canary
    assert canary_deployment.revision == pod_template(TARGET).revision
    # One pod above the count at most, as without an autoscaler.
    assert replicas <= canary + stable <= replicas + 1


def test_a_count_change_is_no_revision() -> None:
    steady = {
        "rollout": {
            "phase": "Complete",
            "strategy": "Canary",
            "stableRevision": pod_template(STABLE).revision,
            "targetRevision": pod_template(STABLE).revision,
            "stableSpec": STABLE.spec.model_dump_json(by_alias=True, exclude_none=True),
        },
        "revisions": [],
    }
    for replicas in (1, 3, 8):
        # The autoscaler wrote spec.replicas: the spec differs, its pod template does not.
        scaled = _plan(replicas=replicas)
        assert pod_template(scaled).revision == pod_template(STABLE).revision
        # ... nor its memory profile's identity: added replicas reuse the profile.
        assert identity_hash(profile_identity(scaled)) == identity_hash(profile_identity(STABLE))
        result = _rollout(scaled, steady)
        assert result.decision.rollout["phase"] == "Complete"
        assert result.decision.events == []
        assert result.decision.canary_replicas == 0
        (deployment,) = result.deployments
        assert deployment.manifest["spec"]["replicas"] == replicas
        assert deployment.revision == pod_template(STABLE).revision
