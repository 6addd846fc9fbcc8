"""Profile once per identity and the pre-flight memory check, on the local control plane.

KWOK runs no containers, so the test writes the profiling pod's termination message in the
kubelet's place; the message is a real profile of our engine committed under
tests/data/profiles/ (see the README there for the command that produced it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from davit_contract.profile import MemoryProfile
from tests.operator.isvc_cluster import OperatorProcess, apply_yaml, condition, get_json, wait_for
from tests.operator.isvc_helpers import merge

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

pytestmark = pytest.mark.cluster

StartOperator = Callable[..., OperatorProcess]
PROFILE_FILE = Path(__file__).resolve().parents[1] / "data" / "profiles" / "h200-qwen3-0.6b.json"
IDENTITY_LABEL = "serving.davit.dev/profile-identity"
KV_FLAG = "--kv-cache-memory-bytes"

SPEC: dict[str, Any] = {
    "model": {"source": "random://qwen3-0.6b"},
    "engine": {"type": "davit", "version": "0.1.0"},
    "accelerator": {"vendor": "nvidia", "product": "NVIDIA-H200"},
    "limits": {"maxModelLen": 8192},
}


def isvc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": spec,
    }


def jobs(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(
        cluster, "get", "jobs", "-n", namespace, "-l", IDENTITY_LABEL
    )["items"]
    return items


def deployment(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any] | None:
    items = get_json(cluster, "get", "deployments", "-n", namespace)["items"]
    return next((d for d in items if d["metadata"]["name"] == name), None)


def status(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = get_json(cluster, "get", "infsvc", name, "-n", namespace)
    return obj.get("status") or {}


def engine_args(dep: dict[str, Any]) -> list[str]:
    args: list[str] = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def finish_profiling_pod(cluster: LocalCluster, namespace: str, job: str, message: str) -> None:
    """Write the profile as the engine container's termination message, as a kubelet would."""

    def succeeded_pod() -> str | None:
        pods = get_json(cluster, "get", "pods", "-n", namespace, "-l", f"job-name={job}")["items"]
        # KWOK completes Job pods at once (without a message): write after it did.
        done = [p for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"]
        return str(done[0]["metadata"]["name"]) if done else None

    pod = wait_for(f"the pod of Job {job}", succeeded_pod, timeout=60)
    patch = {
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {
                    "name": "engine",
                    "image": "engine",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {
                        "terminated": {
                            "exitCode": 0,
                            "reason": "Completed",
                            "message": message,
                        }
                    },
                }
            ],
        }
    }
    cluster.kubectl(
        "patch",
        "pod",
        pod,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(patch),
    )


def test_profile_once_per_identity(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    message = PROFILE_FILE.read_text().strip()
    profile = MemoryProfile.from_json(message)
    kv_bytes = str(profile.memory.kv_cache_bytes)
    start_operator(drift_interval=1.0, memory_profiling=True)

    # First InferenceService: one profiling Job, no replicas until it reports.
    apply_yaml(kube_cluster, kube_namespace, [isvc("first", SPEC)])
    (job,) = wait_for("the profiling Job", lambda: jobs(kube_cluster, kube_namespace))
    job_name = job["metadata"]["name"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-1] == "--profile-only" and KV_FLAG not in container["args"]
    assert job["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == (
        "NVIDIA-H200"
    )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pending = wait_for(
        "a pending memory plan",
        lambda: status(kube_cluster, kube_namespace, "first").get("memoryPlan"),
    )
    assert pending["source"] == "pending" and pending["profile"] == job_name
    assert deployment(kube_cluster, kube_namespace, "first") is None
    obj = get_json(kube_cluster, "get", "infsvc", "first", "-n", kube_namespace)
    assert condition(obj, "MemoryPlanned")["status"] == "False"
    assert condition(obj, "Ready")["reason"] == "ProfilingMemory"
    assert condition(obj, "Reconciling")["status"] == "True"

    finish_profiling_pod(kube_cluster, kube_namespace, job_name, message)
    first = wait_for(
        "the first Deployment", lambda: deployment(kube_cluster, kube_namespace, "first")
    )
    args = engine_args(first)
    assert args[args.index(KV_FLAG) + 1] == kv_bytes
    plan = wait_for(
        "the profiled memory plan",
        lambda: (
            (s := status(kube_cluster, kube_namespace, "first").get("memoryPlan") or {}).get(
                "source"
            )
            == "profile"
            and s
        ),
    )
    assert plan["kvCacheBytes"] == profile.memory.kv_cache_bytes
    assert plan["tokenCapacity"] == profile.memory.token_capacity
    assert plan["cudaGraphBytes"] == profile.memory.cuda_graph_bytes
    assert plan["weightsBytes"] == profile.memory.weights_bytes
    assert float(plan["maxConcurrency"]) == profile.memory.max_concurrency
    obj = get_json(kube_cluster, "get", "infsvc", "first", "-n", kube_namespace)
    assert condition(obj, "MemoryPlanned")["reason"] == "Profile"
    stored = get_json(kube_cluster, "get", "configmap", job_name, "-n", kube_namespace)
    assert stored["metadata"]["labels"][IDENTITY_LABEL] == plan["identityHash"]
    assert MemoryProfile.from_json(stored["data"]["profile.json"]) == profile

    # Same identity under another name: replicas at once, with the same KV bytes, no Job.
    apply_yaml(kube_cluster, kube_namespace, [isvc("second", SPEC)])
    second = wait_for(
        "the second Deployment", lambda: deployment(kube_cluster, kube_namespace, "second")
    )
    args = engine_args(second)
    assert args[args.index(KV_FLAG) + 1] == kv_bytes
    assert [j["metadata"]["name"] for j in jobs(kube_cluster, kube_namespace)] == [job_name]

    # A changed limit is a new identity: a new Job, and no replicas before its profile.
    changed = merge(SPEC, {"limits": {"maxModelLen": 4096}})
    apply_yaml(kube_cluster, kube_namespace, [isvc("third", changed)])
    wait_for("a second profiling Job", lambda: len(jobs(kube_cluster, kube_namespace)) == 2)
    third = wait_for(
        "the third memory plan",
        lambda: status(kube_cluster, kube_namespace, "third").get("memoryPlan"),
    )
    assert third["source"] == "pending" and third["identityHash"] != plan["identityHash"]
    assert deployment(kube_cluster, kube_namespace, "third") is None


def test_a_model_that_cannot_fit_stalls_before_any_pod(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    start_operator(drift_interval=1.0, memory_profiling=True)
    huge = merge(
        SPEC,
        {
            "model": {"source": "hf://meta-llama/Llama-3.1-70B-Instruct", "revision": "main"},
            "limits": {"maxModelLen": 131072},
        },
    )
    apply_yaml(kube_cluster, kube_namespace, [isvc("huge", huge)])

    def stalled() -> dict[str, Any] | None:
        obj = get_json(kube_cluster, "get", "infsvc", "huge", "-n", kube_namespace)
        cond = condition(obj, "Stalled")
        return cond if cond.get("status") == "True" else None

    cond = wait_for("Stalled", stalled)
    assert cond["reason"] == "InsufficientMemory"
    assert "GiB" in cond["message"] and "weights" in cond["message"]
    assert "parallelism.tensor 2 would fit" in cond["message"], cond["message"]
    assert deployment(kube_cluster, kube_namespace, "huge") is None
    assert jobs(kube_cluster, kube_namespace) == []
    pods = get_json(kube_cluster, "get", "pods", "-n", kube_namespace)["items"]
    assert pods == []

    # A model that fits at a shorter length: the message names the largest maxModelLen.
    long = merge(
        SPEC,
        {
            "model": {"source": "random://llama-3.1-8b"},
            "accelerator": {"product": "NVIDIA-L4"},
            "limits": {"maxModelLen": 131072},
        },
    )
    apply_yaml(kube_cluster, kube_namespace, [isvc("long", long)])

    def long_stalled() -> dict[str, Any] | None:
        obj = get_json(kube_cluster, "get", "infsvc", "long", "-n", kube_namespace)
        cond = condition(obj, "Stalled")
        return cond if cond.get("status") == "True" else None

    cond = wait_for("Stalled (maxModelLen)", long_stalled)
    assert cond["reason"] == "InsufficientMemory"
    assert "the largest maxModelLen that fits is" in cond["message"], cond["message"]
    assert deployment(kube_cluster, kube_namespace, "long") is None
