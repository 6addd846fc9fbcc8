"""Scaling and routing on the local control plane: the scale subresource (`kubectl scale`),
the HorizontalPodAutoscaler the API server and its HPA controller accept, a GitOps re-apply
that does not reset the autoscaler's count, CEL rejections naming their field, and the
InferencePool/HTTPRoute with the upstream CRDs (absent first: a condition, no crash)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.conftest import install_gateway_crds
from tests.operator.isvc_cluster import apply_yaml, condition, wait_for
from tests.operator.isvc_helpers import merge

pytestmark = pytest.mark.cluster

NAME = "s"
SPEC: dict[str, Any] = {
    "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"},
    "engine": {"type": "davit", "version": "0.1.0"},
    "accelerator": {"vendor": "cpu"},
    "replicas": 1,
    "limits": {"kvCacheMemoryBytes": 64 << 20},
    "pod": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
}
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 4, "signal": "Both"}
ROUTING = {
    "inferencePool": {
        "endpointPickerRef": {"name": "epp", "port": 9002},
        "httpRoute": {"parentRef": {"name": "inference-gateway"}},
    }
}


def isvc(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": spec,
    }


def get(cluster: Any, namespace: str, kind: str, name: str = NAME) -> dict[str, Any] | None:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        return None
    obj: dict[str, Any] = json.loads(result.stdout)
    return obj


def deployment_replicas(cluster: Any, namespace: str) -> int | None:
    deployment = get(cluster, namespace, "deployment")
    return None if deployment is None else int(deployment["spec"]["replicas"])


def settled(cluster: Any, namespace: str) -> dict[str, Any] | None:
    """The InferenceService once its status describes its current generation."""
    obj = get(cluster, namespace, "infsvc")
    if obj is None:
        return None
    status = obj.get("status") or {}
    return obj if status.get("observedGeneration") == obj["metadata"]["generation"] else None


def client_side_apply(cluster: Any, namespace: str, spec: dict[str, Any]) -> None:
    """`kubectl apply` as a GitOps tool syncing a manifest does (three-way merge)."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(isvc(spec)))


def scale(cluster: Any, namespace: str) -> dict[str, Any]:
    path = f"/apis/serving.davit.dev/v1alpha1/namespaces/{namespace}/inferenceservices/{NAME}/scale"
    result: dict[str, Any] = json.loads(cluster.kubectl("get", "--raw", path).stdout)
    return result


def status_of(cluster: Any, namespace: str) -> dict[str, Any]:
    return dict((get(cluster, namespace, "infsvc") or {}).get("status") or {})


def test_autoscaled_service_keeps_the_autoscalers_count_across_reapplies(
    kube_cluster: Any, kube_namespace: str, start_operator: Any
) -> None:
    ns = kube_namespace
    start_operator(drift_interval=1.0)
    manifest = merge(SPEC, {"autoscaling": AUTOSCALING})
    client_side_apply(kube_cluster, ns, manifest)
    wait_for("the Deployment", lambda: deployment_replicas(kube_cluster, ns) == 1 or None, 60)

    # The operator owns an autoscaling/v2 HPA on the service, which the cluster's own HPA
    # controller reads through the scale subresource (selector included).
    hpa = wait_for("the HPA", lambda: get(kube_cluster, ns, "hpa"), 30)
    owner = hpa["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("InferenceService", NAME, True)
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "InferenceService"
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [
        "vllm_num_requests_waiting",
        "vllm_kv_cache_usage_perc",
    ]
    able = wait_for(
        "the HPA controller to read the scale subresource",
        lambda: (
            condition(get(kube_cluster, ns, "hpa") or {}, "AbleToScale").get("status") == "True"
            or None
        ),
        90,
    )
    assert able
    assert scale(kube_cluster, ns)["status"]["selector"] == (
        f"serving.davit.dev/inferenceservice={NAME}"
    )

    # What the HPA does on load: a write of spec.replicas through the scale subresource.
    kube_cluster.kubectl("scale", "-n", ns, f"infsvc/{NAME}", "--replicas=3")
    wait_for("3 replicas", lambda: deployment_replicas(kube_cluster, ns) == 3 or None, 30)
    wait_for(
        "status.replicas 3",
        lambda: scale(kube_cluster, ns)["status"].get("replicas") == 3 or None,
        60,
    )

    # A GitOps sync re-applies the manifest (replicas: 1): spec.replicas is reset, the count
    # is not, and nothing about the revision changes.
    client_side_apply(kube_cluster, ns, manifest)
    assert scale(kube_cluster, ns)["spec"]["replicas"] == 1
    obj = wait_for("the re-apply observed", lambda: settled(kube_cluster, ns), 30)
    assert obj["status"]["desiredReplicas"] == 3
    # A few reconciles later (drift interval 1 s) the Deployment still runs 3.
    time.sleep(3)
    assert deployment_replicas(kube_cluster, ns) == 3
    # Server-side apply taking spec.replicas over (--force-conflicts) keeps it too.
    kube_cluster.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "-n",
        ns,
        "-f",
        "-",
        input=yaml.safe_dump(isvc(manifest)),
    )
    wait_for("the apply observed", lambda: settled(kube_cluster, ns), 30)
    time.sleep(3)
    assert deployment_replicas(kube_cluster, ns) == 3
    status = status_of(kube_cluster, ns)
    assert len(status["revisions"]) == 1, "a replica count is not a revision"
    assert status["rollout"]["phase"] == "Complete"

    # The autoscaler's range holds for any count written through the subresource.
    kube_cluster.kubectl("scale", "-n", ns, f"infsvc/{NAME}", "--replicas=9")
    wait_for("maxReplicas", lambda: deployment_replicas(kube_cluster, ns) == 4 or None, 30)

    # Without autoscaling the HPA goes and spec.replicas is the count again.
    client_side_apply(kube_cluster, ns, SPEC)
    wait_for("the HPA deleted", lambda: get(kube_cluster, ns, "hpa") is None or None, 30)
    wait_for("1 replica", lambda: deployment_replicas(kube_cluster, ns) == 1 or None, 30)
    kube_cluster.kubectl("scale", "-n", ns, f"infsvc/{NAME}", "--replicas=2")
    wait_for("kubectl scale", lambda: deployment_replicas(kube_cluster, ns) == 2 or None, 30)


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (
            {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
            "spec.autoscaling.minReplicas",
            "must not exceed autoscaling.maxReplicas",
        ),
        ({"autoscaling": {"minReplicas": 1}}, "spec.autoscaling.maxReplicas", "Required"),
        (
            {"autoscaling": {"maxReplicas": 2, "targetWaitingRequests": 0}},
            "spec.autoscaling.targetWaitingRequests",
            "greater than or equal to 1",
        ),
        (
            {"autoscaling": {"maxReplicas": 2, "targetKvCacheUsagePercent": 120}},
            "spec.autoscaling.targetKvCacheUsagePercent",
            "less than or equal to 100",
        ),
        (
            {"autoscaling": {"maxReplicas": 2, "signal": "Latency"}},
            "spec.autoscaling.signal",
            "Unsupported value",
        ),
        (
            {"routing": {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": 0}}}},
            "spec.routing.inferencePool.endpointPickerRef.port",
            "greater than or equal to 1",
        ),
        (
            {"routing": {"inferencePool": {}}},
            "spec.routing.inferencePool.endpointPickerRef",
            "Required",
        ),
    ],
)
def test_bad_autoscaling_and_routing_specs_are_refused_naming_the_field(
    kube_cluster: Any,
    kube_namespace: str,
    isvc_crd: str,
    overrides: dict[str, Any],
    field: str,
    words: str,
) -> None:
    result = kube_cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "-n",
        kube_namespace,
        "-f",
        "-",
        input=yaml.safe_dump(isvc(merge(SPEC, overrides))),
        check=False,
    )
    assert result.returncode != 0
    assert field in result.stderr and words in result.stderr, result.stderr


def test_inference_pool_and_route_absent_crds_then_created_owned_and_collected(
    kube_cluster: Any,
    kube_namespace: str,
    start_operator: Any,
    gateway_crd_files: list[Path],
) -> None:
    ns = kube_namespace

    def crd_exists(name: str) -> bool:
        return kube_cluster.kubectl("get", "crd", name, check=False).returncode == 0

    # Other tests of the session may have installed the HTTPRoute CRD (not InferencePool's).
    pool_served = crd_exists("inferencepools.inference.networking.k8s.io")
    route_served = crd_exists("httproutes.gateway.networking.k8s.io")
    operator = start_operator(drift_interval=1.0)
    apply_yaml(kube_cluster, ns, [isvc(merge(SPEC, {"routing": ROUTING}))])
    if not pool_served:
        # Without the CRDs the service serves through its Service and says what is missing.
        routed = wait_for(
            "Routed False",
            lambda: condition(get(kube_cluster, ns, "infsvc") or {}, "Routed") or None,
            60,
        )
        assert routed["status"] == "False" and routed["reason"] == "RoutingAPIMissing"
        assert "inferencepools.inference.networking.k8s.io" in routed["message"]
        assert ("httproutes.gateway.networking.k8s.io" in routed["message"]) != route_served
        wait_for("the Deployment", lambda: deployment_replicas(kube_cluster, ns) == 1 or None, 60)
        assert operator.process.poll() is None
        install_gateway_crds(kube_cluster, gateway_crd_files)
        # A fresh process asks the API server again at once (a running one within a minute).
        operator.stop()
        start_operator(drift_interval=1.0)
    else:
        install_gateway_crds(kube_cluster, gateway_crd_files)
    pool = wait_for("the InferencePool", lambda: get(kube_cluster, ns, "inferencepool"), 60)
    route = wait_for("the HTTPRoute", lambda: get(kube_cluster, ns, "httproute"), 30)
    uid = get(kube_cluster, ns, "infsvc")["metadata"]["uid"]
    for child in (pool, route):
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceService", uid, True)
    assert pool["spec"]["selector"]["matchLabels"] == {"serving.davit.dev/inferenceservice": NAME}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "epp"
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"][0]["kind"] == "InferencePool"
    assert rule["backendRefs"][0]["name"] == NAME
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    routed = wait_for(
        "Routed True",
        lambda: (
            condition(get(kube_cluster, ns, "infsvc") or {}, "Routed").get("status") == "True"
            or None
        ),
        30,
    )
    assert routed
    # Dropping the route from the spec deletes it; the pool stays.
    no_route = {"inferencePool": {"endpointPickerRef": {"name": "epp"}}}
    apply_yaml(kube_cluster, ns, [isvc(merge(SPEC, {"routing": no_route}))])
    wait_for(
        "the HTTPRoute deleted", lambda: get(kube_cluster, ns, "httproute") is None or None, 30
    )
    assert get(kube_cluster, ns, "inferencepool") is not None
    # Garbage collection removes the pool with the service.
    kube_cluster.kubectl("delete", "infsvc", NAME, "-n", ns, "--timeout=60s")
    wait_for(
        "the pool collected", lambda: get(kube_cluster, ns, "inferencepool") is None or None, 60
    )
