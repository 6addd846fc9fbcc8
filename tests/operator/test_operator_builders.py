"""Builders: the children a plan produces, deterministic and owned."""

from __future__ import annotations

from typing import Any

from isvc_helpers import make_spec

from davit_operator.builders.budget import pod_disruption_budget
from davit_operator.builders.children import children
from davit_operator.builders.deployment import engine_deployment
from davit_operator.builders.metadata import Owner
from davit_operator.builders.service import service
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.plan import Plan, make_plan

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="0b9c5c3e-1111-2222-3333-444455556666")


def deployment(plan: Plan, owner: Owner) -> dict[str, Any]:
    """The stable track's Deployment at the plan's replica count."""
    return engine_deployment(plan, owner, "stable", plan.replicas).manifest


def test_deployment_for_davit_on_h200() -> None:
    plan = make_plan("svc", "ns", make_spec(replicas=3), CATALOG)
    dep = deployment(plan, OWNER)
    assert dep["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "serving.davit.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "svc",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["selector"] == {"matchLabels": {"serving.davit.dev/inferenceservice": "svc"}}
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    container = pod["containers"][0]
    assert container["image"] == "ghcr.io/davit-dev/davit-engine:0.1.0-cuda13.0"
    assert container["command"] == ["davit", "serve"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert (
        container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"]
        >= 1800
    )
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "davit-operator"
    assert deployment(plan, OWNER) == dep, "builders are deterministic"


def test_vllm_probes_use_its_health_endpoint() -> None:
    plan = make_plan("svc", "ns", make_spec(engine={"type": "vllm", "version": "0.33.0"}), CATALOG)
    container = deployment(plan, OWNER)["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["image"] == "vllm/vllm-openai:v0.33.0rc3"


def test_pvc_model_is_mounted_read_only() -> None:
    spec = make_spec(model={"source": "pvc://weights/qwen3", "revision": None})
    pod = deployment(make_plan("svc", "ns", spec, CATALOG), OWNER)["spec"]["template"]["spec"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in (pod["volumes"])
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "model", "mountPath": "/models/weights", "readOnly": True} in mounts


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
