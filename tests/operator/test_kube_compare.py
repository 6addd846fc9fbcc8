"""Owned-field comparison: what makes the operator write a child, and what does not."""

from __future__ import annotations

import copy
from typing import Any

from davit_operator.builders.deployment import engine_deployment
from davit_operator.builders.digest import DESIRED_HASH_ANNOTATION, with_hash
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import load_catalog
from davit_operator.kube import is_subset, needs_apply
from davit_operator.planning.plan import make_plan
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="uid-1")


def _desired(**overrides: Any) -> dict[str, Any]:
    plan = make_plan("svc", "ns", make_spec(**overrides), CATALOG)
    return with_hash(engine_deployment(plan, OWNER, "stable", plan.replicas).manifest)


def _as_served(obj: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns: defaults filled in, metadata and status added."""
    live = copy.deepcopy(obj)
    live["metadata"].update({"uid": "d-1", "resourceVersion": "42", "generation": 1})
    live["spec"]["revisionHistoryLimit"] = 10
    live["spec"]["progressDeadlineSeconds"] = 600
    pod = live["spec"]["template"]["spec"]
    pod.update({"restartPolicy": "Always", "dnsPolicy": "ClusterFirst", "schedulerName": "x"})
    container = pod["containers"][0]
    container["imagePullPolicy"] = "IfNotPresent"
    container["terminationMessagePath"] = "/dev/termination-log"
    container["readinessProbe"]["httpGet"]["scheme"] = "HTTP"
    container["readinessProbe"]["successThreshold"] = 1
    container["resources"]["requests"]["nvidia.com/gpu"] = "1"
    live["status"] = {"replicas": 1, "readyReplicas": 1}
    return live


def test_new_child_needs_apply() -> None:
    assert needs_apply(_desired(), None)


def test_server_defaults_do_not_trigger_a_write() -> None:
    desired = _desired()
    assert not needs_apply(desired, _as_served(desired))


def test_changed_intent_triggers_a_write() -> None:
    live = _as_served(_desired())
    changed = _desired(limits={"maxModelLen": 4096})
    assert (
        changed["metadata"]["annotations"][DESIRED_HASH_ANNOTATION]
        != (live["metadata"]["annotations"][DESIRED_HASH_ANNOTATION])
    )
    assert needs_apply(changed, live)


def test_drift_of_an_owned_field_triggers_a_write() -> None:
    desired = _desired()
    live = _as_served(desired)
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:latest"
    assert needs_apply(desired, live)
    live = _as_served(desired)
    live["spec"]["replicas"] = 5
    assert needs_apply(desired, live)
    live = _as_served(desired)
    del live["spec"]["template"]["spec"]["nodeSelector"]
    assert needs_apply(desired, live)


def test_quantities_compare_by_value() -> None:
    assert is_subset({"cpu": "0.5", "memory": "1024Mi"}, {"cpu": "500m", "memory": "1Gi"})
    assert not is_subset({"cpu": "1"}, {"cpu": "500m"})
    assert not is_subset({"image": "a:1"}, {"image": "a:2"})
    assert not is_subset({"args": ["a", "b"]}, {"args": ["a"]})
    assert is_subset({"x": 0.9}, {"x": 0.9})
