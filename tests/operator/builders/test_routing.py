"""The InferencePool and HTTPRoute builders."""

from __future__ import annotations

from typing import Any

from davit_operator.api.routing import InferencePoolSpec
from davit_operator.builders.metadata import Owner
from davit_operator.builders.routing import http_route, inference_pool
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.plan import make_plan
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="uid-1")
PLAN = make_plan("svc", "ns", make_spec(), CATALOG)


def _pool(**fields: Any) -> InferencePoolSpec:
    return InferencePoolSpec.model_validate({"endpointPickerRef": {"name": "epp"}, **fields})


def test_pool_selects_every_engine_pod_on_the_engine_port() -> None:
    pool = inference_pool(PLAN, OWNER, _pool())
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "svc"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # The instance label alone: stable and canary pods are both members.
    assert pool["spec"]["selector"] == {
        "matchLabels": {"serving.davit.dev/inferenceservice": "svc"}
    }
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }


def test_picker_port_and_failure_mode_are_configurable() -> None:
    spec = _pool(endpointPickerRef={"name": "picker", "port": 9100, "failureMode": "FailOpen"})
    ref = inference_pool(PLAN, OWNER, spec)["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"], ref["failureMode"]) == (
        "picker",
        {"number": 9100},
        "FailOpen",
    )


def test_no_route_unless_asked() -> None:
    assert http_route(PLAN, OWNER, _pool()) is None


def test_route_sends_its_prefix_to_the_pool() -> None:
    spec = _pool(
        httpRoute={
            "parentRef": {"name": "gw", "namespace": "infra", "sectionName": "http"},
            "pathPrefix": "/v1",
        }
    )
    route = http_route(PLAN, OWNER, spec)
    assert route is not None
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert route["spec"]["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "gw",
            "namespace": "infra",
            "sectionName": "http",
        }
    ]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": "svc",
            "weight": 1,
        }
    ]
