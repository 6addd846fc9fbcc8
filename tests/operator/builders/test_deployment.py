"""The engine Deployment: deterministic and owned, on either track, with its revision."""

from __future__ import annotations

from typing import Any

from davit_operator.builders.deployment import (
    REVISION_ANNOTATION,
    TRACK_LABEL,
    engine_deployment,
    pod_template,
)
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.plan import Plan, make_plan
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="0b9c5c3e-1111-2222-3333-444455556666")
INSTANCE = "serving.davit.dev/inferenceservice"


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


def test_canary_deployment_sits_inside_the_service_selector_with_its_own() -> None:
    plan = make_plan("svc", "ns", make_spec(replicas=4, limits={"maxNumSeqs": 8}), CATALOG)
    built = engine_deployment(plan, OWNER, "canary", 1)
    canary = built.manifest
    revision = pod_template(plan).revision
    assert built.revision == revision
    assert canary["metadata"]["name"] == "svc-canary"
    assert canary["spec"]["replicas"] == 1
    assert canary["spec"]["selector"]["matchLabels"] == {INSTANCE: "svc", TRACK_LABEL: "canary"}
    labels = canary["spec"]["template"]["metadata"]["labels"]
    assert labels[INSTANCE] == "svc" and labels[TRACK_LABEL] == "canary"
    assert labels["serving.davit.dev/revision"] == revision
    assert canary["metadata"]["annotations"] == {REVISION_ANNOTATION: revision}
    # Same engine as the stable Deployment would run for this plan.
    stable_built = engine_deployment(plan, OWNER, "stable", 3)
    stable = stable_built.manifest
    assert stable_built.revision == revision
    assert stable["metadata"]["annotations"] == {REVISION_ANNOTATION: revision}
    assert (
        canary["spec"]["template"]["spec"]["containers"]
        == stable["spec"]["template"]["spec"]["containers"]
    )
    assert stable["spec"]["selector"]["matchLabels"] == {INSTANCE: "svc"}
    assert TRACK_LABEL not in stable["spec"]["template"]["metadata"]["labels"]
    marked = engine_deployment(plan, OWNER, "stable", 3, paused=True, track_labels=True).manifest
    assert marked["spec"]["paused"] is True
    assert marked["spec"]["template"]["metadata"]["labels"][TRACK_LABEL] == "stable"


def test_revision_ignores_replicas_and_follows_the_engine() -> None:
    a = make_plan("svc", "ns", make_spec(replicas=1), CATALOG)
    b = make_plan("svc", "ns", make_spec(replicas=5), CATALOG)
    c = make_plan("svc", "ns", make_spec(replicas=1, limits={"maxModelLen": 4096}), CATALOG)
    assert pod_template(a).revision == pod_template(b).revision
    assert pod_template(a).revision != pod_template(c).revision
    # A track or a replica count is no new revision either.
    on_canary = engine_deployment(b, OWNER, "canary", 2).revision
    assert engine_deployment(a, OWNER, "stable", 1).revision == on_canary


def test_drain_settings_match_the_engine_flag() -> None:
    plan = make_plan("svc", "ns", make_spec(rollout={"drainSeconds": 45}), CATALOG)
    built = engine_deployment(plan, OWNER, "stable", 1).manifest
    pod = built["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert pod["terminationGracePeriodSeconds"] == 5 + 45 + 10
    args = container["args"]
    assert args[args.index("--drain-timeout") + 1] == "45"
    strategy = built["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 1}
