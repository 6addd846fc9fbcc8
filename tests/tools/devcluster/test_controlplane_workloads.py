"""Workloads on the fake nodes: scheduling by accelerator, readiness, Jobs, garbage collection."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import pytest

from davit_tools.devcluster import LocalCluster

pytestmark = pytest.mark.cluster

POD_NETWORK = ipaddress.ip_network("127.64.0.0/16")


def _deployment(name: str, replicas: int, resources: dict[str, str]) -> str:
    return json.dumps(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        "containers": [
                            {
                                "name": "engine",
                                "image": "registry.invalid/davit/engine:test",
                                "resources": {"requests": resources, "limits": resources},
                            }
                        ]
                    },
                },
            },
        }
    )


def _pods(kube_cluster: LocalCluster, namespace: str, app: str) -> list[Any]:
    listing = kube_cluster.kubectl_json("get", "pods", "-n", namespace, "-l", f"app={app}")
    return list(listing["items"])


def _rollout(kube_cluster: LocalCluster, namespace: str, name: str) -> None:
    kube_cluster.kubectl(
        "rollout", "status", f"deployment/{name}", "-n", namespace, "--timeout=90s", timeout=100
    )


def _assert_ready_on_loopback(pod: Any) -> None:
    conditions = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert conditions.get("Ready") == "True"
    assert pod["status"]["phase"] == "Running"
    assert ipaddress.ip_address(pod["status"]["podIP"]) in POD_NETWORK


def test_h200_deployment_fills_both_h200_nodes_then_runs_out_of_gpus(
    kube_cluster: LocalCluster, kube_namespace: str
) -> None:
    ns = kube_namespace
    kube_cluster.kubectl(
        "apply", "-n", ns, "-f", "-", input=_deployment("qwen", 2, {"nvidia.com/gpu": "8"})
    )
    _rollout(kube_cluster, ns, "qwen")
    pods = _pods(kube_cluster, ns, "qwen")
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["gpu-h200-0", "gpu-h200-1"]
    for pod in pods:
        _assert_ready_on_loopback(pod)

    # Each H200 node has 8 GPUs: a third 8-GPU replica must stay Pending, which shows the
    # scheduler counts the extended resource instead of ignoring it.
    kube_cluster.kubectl("scale", "deployment/qwen", "-n", ns, "--replicas=3")
    kube_cluster.kubectl(
        "wait",
        "pod",
        "-n",
        ns,
        "-l",
        "app=qwen",
        "--for=jsonpath={.status.phase}=Pending",
        "--field-selector=status.phase=Pending",
        "--timeout=60s",
        timeout=70,
    )
    pending = [p for p in _pods(kube_cluster, ns, "qwen") if not p["spec"].get("nodeName")]
    assert len(pending) == 1
    kube_cluster.kubectl(
        "wait",
        f"pod/{pending[0]['metadata']['name']}",
        "-n",
        ns,
        "--for=condition=PodScheduled=False",
        "--timeout=60s",
        timeout=70,
    )
    events = kube_cluster.kubectl(
        "get",
        "events",
        "-n",
        ns,
        f"--field-selector=involvedObject.name={pending[0]['metadata']['name']}",
        "-o",
        "jsonpath={.items[*].message}",
    ).stdout
    assert "Insufficient nvidia.com/gpu" in events


@pytest.mark.parametrize(
    ("resource", "node"),
    [("amd.com/gpu", "gpu-mi300x-0"), ("gpu.intel.com/i915", "gpu-max1550-0")],
)
def test_vendor_gpu_request_lands_on_that_vendors_node(
    kube_cluster: LocalCluster, kube_namespace: str, resource: str, node: str
) -> None:
    kube_cluster.kubectl(
        "apply", "-n", kube_namespace, "-f", "-", input=_deployment("engine", 1, {resource: "1"})
    )
    _rollout(kube_cluster, kube_namespace, "engine")
    (pod,) = _pods(kube_cluster, kube_namespace, "engine")
    assert pod["spec"]["nodeName"] == node
    _assert_ready_on_loopback(pod)


def test_job_pod_completes(kube_cluster: LocalCluster, kube_namespace: str) -> None:
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "profile"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "profile", "image": "registry.invalid/profile:1"}],
                }
            },
        },
    }
    kube_cluster.kubectl("apply", "-n", kube_namespace, "-f", "-", input=json.dumps(job))
    kube_cluster.kubectl(
        "wait",
        "job/profile",
        "-n",
        kube_namespace,
        "--for=condition=Complete",
        "--timeout=90s",
        timeout=100,
    )
    pods = kube_cluster.kubectl_json(
        "get", "pods", "-n", kube_namespace, "-l", "batch.kubernetes.io/job-name=profile"
    )["items"]
    assert [p["status"]["phase"] for p in pods] == ["Succeeded"]
    assert (
        kube_cluster.kubectl_json("get", "job/profile", "-n", kube_namespace)["status"]["succeeded"]
        == 1
    )


def test_deleting_an_owner_garbage_collects_what_it_owns(
    kube_cluster: LocalCluster, kube_namespace: str
) -> None:
    ns = kube_namespace
    kube_cluster.kubectl("create", "configmap", "owner", "-n", ns, "--from-literal=a=1")
    uid = kube_cluster.kubectl_json("get", "configmap/owner", "-n", ns)["metadata"]["uid"]
    owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
            ],
        },
        "data": {"b": "2"},
    }
    kube_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(owned))
    kube_cluster.kubectl("apply", "-n", ns, "-f", "-", input=_deployment("web", 1, {"cpu": "1"}))
    _rollout(kube_cluster, ns, "web")
    (pod,) = _pods(kube_cluster, ns, "web")
    assert pod["spec"]["nodeName"]

    # Background propagation: the API server deletes the owner at once and the garbage
    # collector in kube-controller-manager removes the dependents afterwards.
    kube_cluster.kubectl("delete", "configmap/owner", "-n", ns, "--cascade=background")
    kube_cluster.kubectl(
        "wait", "configmap/owned", "-n", ns, "--for=delete", "--timeout=60s", timeout=70
    )
    kube_cluster.kubectl("delete", "deployment/web", "-n", ns, "--cascade=background")
    kube_cluster.kubectl(
        "wait", "pod", "-n", ns, "-l", "app=web", "--for=delete", "--timeout=60s", timeout=70
    )
    leftovers = kube_cluster.kubectl("get", "replicasets,pods", "-n", ns, "-o", "name").stdout
    assert leftovers.strip() == ""


def test_service_gets_a_loopback_cluster_ip(
    kube_cluster: LocalCluster, kube_namespace: str
) -> None:
    kube_cluster.kubectl(
        "create", "service", "clusterip", "engine", "--tcp=8000:8000", "-n", kube_namespace
    )
    service = kube_cluster.kubectl_json("get", "service/engine", "-n", kube_namespace)
    assert ipaddress.ip_address(service["spec"]["clusterIP"]).is_loopback
