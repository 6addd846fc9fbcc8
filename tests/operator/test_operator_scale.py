"""Scale: many InferenceServices applied at once all reach Ready; time, operator memory and CPU.

Every service has `spec.autoscaling`, so the operator applies three children per service
(Deployment, Service, HorizontalPodAutoscaler) and the cluster's HPA controller syncs one HPA per
service while the rest happens.

Run alone with figures printed:
    python -m pytest -s -m slow tests/operator/test_operator_scale.py
`DAVIT_SCALE_COUNT` changes the number of objects (default 200). When the default fake nodes
(5 x 110 pods) cannot hold the engine pods plus headroom, the test adds plain CPU fake nodes of
110 pods each (the kubelet's default, as on real clusters) for its duration.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.operator.isvc_cluster import OperatorProcess, condition, get_json, wait_for

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

COUNT = int(os.environ.get("DAVIT_SCALE_COUNT", "200"))
DRIFT_INTERVAL = 5.0
IDLE_SECONDS = 20.0
PODS_PER_NODE = 110
# Free pod slots kept beyond the engine pods (other pods, a surge, an uneven spread).
HEADROOM = max(50, COUNT // 10)
# One apply of 1,000 objects alone takes minutes on a loaded 2-core machine.
READY_TIMEOUT = max(600.0, 1.2 * COUNT)

# The whole test (cluster start, nodes, apply, Ready, idle check, teardown) outlasts the
# session's default timeout for big counts.
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(max(900, int(2 * READY_TIMEOUT) + 300)),
]


@pytest.fixture
def scale_nodes(kube_cluster: LocalCluster) -> Iterator[list[str]]:
    """Adds CPU fake nodes when the cluster's free pod slots cannot hold COUNT + HEADROOM pods;
    yields the names of the nodes Ready for pods. Removed again after the test (request this
    fixture before `kube_namespace`, so the namespace's pods are gone first)."""
    from davit_tools.devcluster.nodes import cpu_node

    nodes = get_json(kube_cluster, "get", "nodes")["items"]
    pods = get_json(kube_cluster, "get", "pods", "-A")["items"]
    slots = sum(
        int(n["status"]["allocatable"].get("pods", "0"))
        for n in nodes
        if not n["spec"].get("unschedulable") and condition(n, "Ready").get("status") == "True"
    )
    used = sum(p["status"].get("phase") not in ("Succeeded", "Failed") for p in pods)
    missing = COUNT + HEADROOM - (slots - used)
    extra = [cpu_node(f"cpu-scale-{i}") for i in range(math.ceil(max(0, missing) / PODS_PER_NODE))]
    kube_cluster.add_nodes(extra)
    try:
        yield [n["metadata"]["name"] for n in nodes] + [n.name for n in extra]
    finally:
        kube_cluster.remove_nodes([n.name for n in extra])


def _document(index: int) -> dict[str, Any]:
    return {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": f"scale-{index:03d}"},
        "spec": {
            "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"},
            "engine": {"type": "davit", "version": "0.1.0"},
            "accelerator": {"vendor": "cpu"},
            "pod": {"resources": {"requests": {"cpu": "10m", "memory": "64Mi"}}},
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 3,
                "signal": "WaitingRequests",
                "targetWaitingRequests": 2,
            },
        },
    }


def test_many_services_reach_ready(
    scale_nodes: list[str],
    kube_cluster: LocalCluster,
    kube_namespace: str,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    operator = start_operator(drift_interval=DRIFT_INTERVAL)
    try:
        _check_scale(scale_nodes, kube_cluster, kube_namespace, operator)
    finally:
        _delete_at_scale(kube_cluster, kube_namespace)


def _delete_at_scale(cluster: LocalCluster, namespace: str) -> None:
    """Deletes the services (the operator releases their finalizers) and their workloads with
    time for COUNT objects; the shared fixtures' cleanup is sized for a few."""
    budget = max(120.0, 0.5 * COUNT)
    cluster.kubectl("delete", "infsvc", "--all", "-n", namespace, "--wait=false", timeout=budget)
    wait_for(
        f"{COUNT} InferenceServices deleted",
        lambda: not get_json(cluster, "get", "infsvc", "-n", namespace)["items"],
        timeout=budget,
        interval=2.0,
    )
    cluster.kubectl(
        "delete", "deployments.apps,replicasets.apps,pods", "--all", "-n", namespace,
        "--wait=false", timeout=budget,
    )  # fmt: skip
    wait_for(
        f"{COUNT} engine pods deleted",
        lambda: not cluster.kubectl("get", "pods", "-n", namespace, "-o", "name").stdout.strip(),
        timeout=budget,
        interval=2.0,
    )


def _check_scale(
    scale_nodes: list[str], kube_cluster: LocalCluster, kube_namespace: str,
    operator: OperatorProcess,
) -> None:  # fmt: skip
    baseline_mib = operator.peak_rss_mib()
    cpu_start = _cpu_seconds(operator.pid)
    documents = [_document(i) for i in range(COUNT)]
    payload = "\n---\n".join(json.dumps(doc) for doc in documents)
    started = time.monotonic()
    kube_cluster.kubectl(
        "apply",
        "--server-side",
        "-n",
        kube_namespace,
        "-f",
        "-",
        input=payload,
        timeout=READY_TIMEOUT,
    )
    applied = time.monotonic() - started

    def ready_count() -> int:
        items = get_json(kube_cluster, "get", "infsvc", "-n", kube_namespace)["items"]
        return sum(condition(item, "Ready").get("status") == "True" for item in items)

    counts: list[int] = []

    def all_ready() -> bool:
        counts.append(ready_count())
        return counts[-1] == COUNT

    wait_for(f"{COUNT} InferenceServices Ready", all_ready, timeout=READY_TIMEOUT, interval=2.0)
    elapsed = time.monotonic() - started
    peak_mib = operator.peak_rss_mib()
    busy_cpu = _cpu_seconds(operator.pid) - cpu_start
    services = get_json(kube_cluster, "get", "infsvc", "-n", kube_namespace)["items"]
    uids = {s["metadata"]["name"]: s["metadata"]["uid"] for s in services}
    hpas = get_json(kube_cluster, "get", "hpa", "-n", kube_namespace)["items"]
    assert sorted(h["metadata"]["name"] for h in hpas) == sorted(uids)
    for hpa in hpas:
        (owner,) = hpa["metadata"]["ownerReferences"]
        assert owner["kind"] == "InferenceService" and owner["controller"] is True
        assert owner["uid"] == uids[hpa["metadata"]["name"]]
        assert hpa["spec"]["scaleTargetRef"]["name"] == hpa["metadata"]["name"]
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    deployments = get_json(kube_cluster, "get", "deployments", "-n", kube_namespace)["items"]
    assert len(deployments) == COUNT
    pods = get_json(kube_cluster, "get", "pods", "-n", kube_namespace)["items"]
    assert sum(condition(p, "Ready").get("status") == "True" for p in pods) == COUNT
    writes = operator.metric("davit_operator_child_writes_total")
    print(
        f"\nscale: {COUNT} InferenceServices (cpu, 1 replica, autoscaling 1-3, davit 0.1.0) on "
        f"{len(scale_nodes)} KWOK nodes; operator drift interval {DRIFT_INTERVAL} s; "
        f"apply took {applied:.1f} s; all Ready after {elapsed:.1f} s; "
        f"operator peak RSS {peak_mib:.0f} MiB (idle before: {baseline_mib:.0f} MiB); "
        f"operator CPU {busy_cpu:.1f} s (user+system) from start of apply to all Ready; "
        f"child writes {writes:.0f}, {len(hpas)} HPAs owned"
    )
    by_kind = {
        kind: operator.metric("davit_operator_child_writes_total", kind=kind)
        for kind in ("Deployment", "Service", "HorizontalPodAutoscaler")
    }
    assert writes == 3 * COUNT, f"one apply per child and object, no more: {by_kind}"

    # Idle at scale: every timer tick reconciles every object and nothing is written.
    time.sleep(2 * DRIFT_INTERVAL)
    before = _versions(kube_cluster, kube_namespace)
    status_writes = operator.metric("davit_operator_status_writes_total")
    ticks = operator.metric("davit_operator_reconcile_total", trigger="timer")
    cpu_before = _cpu_seconds(operator.pid)
    time.sleep(IDLE_SECONDS)
    idle_cpu = (_cpu_seconds(operator.pid) - cpu_before) / IDLE_SECONDS
    idle_ticks = operator.metric("davit_operator_reconcile_total", trigger="timer") - ticks
    assert idle_ticks >= COUNT * (IDLE_SECONDS / DRIFT_INTERVAL - 1)
    assert _versions(kube_cluster, kube_namespace) == before
    assert operator.metric("davit_operator_child_writes_total") == writes
    assert operator.metric("davit_operator_status_writes_total") == status_writes
    print(
        f"scale idle {IDLE_SECONDS:.0f} s: {idle_ticks:.0f} timer reconciles, 0 writes, "
        f"operator CPU {idle_cpu * 100:.0f}% of one core"
    )


def _versions(cluster: LocalCluster, namespace: str) -> dict[str, str]:
    found = {}
    for kind in ("infsvc", "deployments", "services"):
        for item in get_json(cluster, "get", kind, "-n", namespace)["items"]:
            found[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return found


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks_per_second
