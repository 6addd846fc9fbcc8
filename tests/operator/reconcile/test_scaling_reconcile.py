"""Autoscaling and routing inside a reconcile, with a recording client: the HPA and the
InferencePool come and go with the spec, the pool only where its CRD is served, the replica
count follows the scale subresource, and status carries replicas, selector and Routed."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kopf

from davit_operator.builders.children import children
from davit_operator.builders.deployment import engine_deployment
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.plan import make_plan
from davit_operator.reconcile.apply import apply_children
from davit_operator.reconcile.indexes import Indexes
from davit_operator.reconcile.memo import ObjectMemo
from davit_operator.reconcile.reconciler import reconcile
from davit_operator.reconcile.runtime import EMPTY_DIR_CACHE, Runtime
from tests.operator.isvc_helpers import make_spec, spec_dict

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="uid-1")
KEY = ("ns", "svc")
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 5}
ROUTING = {
    "inferencePool": {
        "endpointPickerRef": {"name": "epp"},
        "httpRoute": {"parentRef": {"name": "gw"}},
    }
}


class Client:
    """Answers like the API server; `served` says whether the routing CRDs exist."""

    def __init__(self, served: bool = True) -> None:
        self.served = served
        self.applied: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.asked: list[str] = []

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(obj)
        live = copy.deepcopy(obj)
        live["metadata"]["uid"] = f"{obj['kind']}-uid"
        return live

    async def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        self.deleted.append(f"{kind}/{name}")

    async def serves(self, group_version: str, plural: str) -> bool:
        self.asked.append(plural)
        return self.served

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return None

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[Any]:
        return []

    def kinds(self) -> list[str]:
        return [o["kind"] for o in self.applied]


def _kinds(built: list[dict[str, Any]]) -> list[str]:
    return [o["kind"] for o in built]


def test_children_follow_the_spec_and_what_the_cluster_serves() -> None:
    plan = make_plan("svc", "ns", make_spec(autoscaling=AUTOSCALING, routing=ROUTING), CATALOG)
    stable = engine_deployment(plan, OWNER, "stable", 1).manifest
    assert _kinds(children(plan, OWNER, [stable])) == [
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
    ]
    assert _kinds(children(plan, OWNER, [stable], served={"InferencePool"}))[-1] == "InferencePool"
    assert _kinds(children(plan, OWNER, [stable], served={"InferencePool", "HTTPRoute"}))[-2:] == [
        "InferencePool",
        "HTTPRoute",
    ]
    plain = make_plan("svc", "ns", make_spec(), CATALOG)
    assert _kinds(children(plain, OWNER, [stable], served={"InferencePool", "HTTPRoute"})) == [
        "Deployment",
        "Service",
    ]


def test_children_no_longer_wanted_are_deleted_once() -> None:
    client = Client()
    memo = ObjectMemo()
    live = {
        kind: {"metadata": {"name": "svc", "uid": f"{kind}-uid"}}
        for kind in ("HorizontalPodAutoscaler", "InferencePool", "HTTPRoute")
    }
    indexes = Indexes(
        deployments={},  # type: ignore[arg-type]
        services={},  # type: ignore[arg-type]
        budgets={},  # type: ignore[arg-type]
        nodes={},  # type: ignore[arg-type]
        autoscalers={KEY: [live["HorizontalPodAutoscaler"]]},  # type: ignore[arg-type]
        pools={KEY: [live["InferencePool"]]},  # type: ignore[arg-type]
        routes={KEY: [live["HTTPRoute"]]},  # type: ignore[arg-type]
    )
    plan = make_plan("svc", "ns", make_spec(), CATALOG)
    desired = children(plan, OWNER, [engine_deployment(plan, OWNER, "stable", 1).manifest])
    kube: Any = client
    applied = asyncio.run(apply_children(kube, "ns", "svc", desired, indexes, memo))
    assert client.deleted == ["HorizontalPodAutoscaler/svc", "InferencePool/svc", "HTTPRoute/svc"]
    assert "deleted HorizontalPodAutoscaler" in applied.writes
    # The watch still shows them: not deleted twice.
    asyncio.run(apply_children(kube, "ns", "svc", desired, indexes, memo))
    assert len(client.deleted) == 3


EVENTS: list[tuple[str, str]] = []


def _record(body: kopf.Body, type: str, reason: str, message: str) -> None:
    EVENTS.append((type, reason))


def _reconcile(
    client: Client,
    spec: dict[str, Any],
    status: dict[str, Any] | None = None,
    **meta: Any,
) -> tuple[dict[str, Any], kopf.Patch]:
    EVENTS.clear()
    body = {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": "ns", "uid": "uid-1", "generation": 2, **meta},
        "spec": spec,
        "status": status or {},
    }
    patch = kopf.Patch()
    asyncio.run(
        reconcile(
            trigger="update",
            runtime=Runtime(
                catalog=CATALOG,
                kube=client,  # type: ignore[arg-type]
                post_event=_record,
                model_cache=EMPTY_DIR_CACHE,
            ),
            body=kopf.Body(body),
            patch=patch,
            indexes=Indexes(deployments={}, services={}, budgets={}, nodes={}),  # type: ignore[arg-type]
            memo=ObjectMemo(),
            retry_delay=1.0,
        )
    )
    return body, patch


def _deployment_replicas(client: Client) -> int:
    (deployment,) = [o for o in client.applied if o["kind"] == "Deployment"]
    return int(deployment["spec"]["replicas"])


def test_status_names_the_selector_and_routing_waits_for_its_crds() -> None:
    client = Client(served=False)
    _, patch = _reconcile(client, spec_dict(routing=ROUTING))
    status = patch["status"]
    assert status["selector"] == "serving.davit.dev/inferenceservice=svc"
    assert status["replicas"] == 0
    routed = next(c for c in status["conditions"] if c["type"] == "Routed")
    assert (routed["status"], routed["reason"]) == ("False", "RoutingAPIMissing")
    assert "inferencepools.inference.networking.k8s.io" in routed["message"]
    assert "httproutes.gateway.networking.k8s.io" in routed["message"]
    assert "InferencePool" not in client.kinds()
    assert ("Warning", "RoutingAPIMissing") in EVENTS
    # Once written, the same state posts nothing again.
    _reconcile(Client(served=False), spec_dict(routing=ROUTING), status={"conditions": [routed]})
    assert all(reason != "RoutingAPIMissing" for _, reason in EVENTS)
    served = Client(served=True)
    _, patch = _reconcile(served, spec_dict(routing=ROUTING), status={"conditions": [routed]})
    routed = next(c for c in patch["status"]["conditions"] if c["type"] == "Routed")
    assert (routed["status"], routed["reason"]) == ("True", "InferencePoolCreated")
    assert ("Normal", "InferencePoolCreated") in EVENTS
    assert served.kinds()[-2:] == ["InferencePool", "HTTPRoute"]


def test_no_routing_asks_nothing_and_reports_no_routed_condition() -> None:
    client = Client()
    _, patch = _reconcile(client, spec_dict())
    assert client.asked == []
    assert all(c["type"] != "Routed" for c in patch["status"]["conditions"])


SCALE_WRITE = {
    "manager": "kube-controller-manager",
    "operation": "Update",
    "subresource": "scale",
    "fieldsV1": {"f:spec": {"f:replicas": {}}},
}
APPLY_WRITE = {
    "manager": "argocd-controller",
    "operation": "Apply",
    "fieldsV1": {"f:spec": {"f:replicas": {}, "f:model": {}}},
}


def test_replicas_follow_the_scale_subresource_not_a_reapply() -> None:
    spec = spec_dict(autoscaling=AUTOSCALING, replicas=1)
    client = Client()
    _, patch = _reconcile(
        client, spec_dict(autoscaling=AUTOSCALING, replicas=3), managedFields=[SCALE_WRITE]
    )
    assert _deployment_replicas(client) == 3
    assert patch["status"]["desiredReplicas"] == 3
    assert "HorizontalPodAutoscaler" in client.kinds()
    # The manifest says 1 again (a GitOps sync): the recorded 3 stays.
    client = Client()
    _reconcile(client, spec, managedFields=[APPLY_WRITE], status={"desiredReplicas": 3})
    assert _deployment_replicas(client) == 3
    # Without autoscaling the spec decides.
    client = Client()
    _reconcile(
        client, spec_dict(replicas=1), managedFields=[APPLY_WRITE], status={"desiredReplicas": 3}
    )
    assert _deployment_replicas(client) == 1
