"""Scale: many InferenceServices applied at once all reach Ready; time and operator memory.

Run alone with figures printed:
    python -m pytest -s -m slow tests/operator/test_operator_scale.py
`DAVIT_SCALE_COUNT` changes the number of objects (default 200).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.operator.isvc_cluster import OperatorProcess, condition, get_json, wait_for

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

COUNT = int(os.environ.get("DAVIT_SCALE_COUNT", "200"))
DRIFT_INTERVAL = 5.0
IDLE_SECONDS = 20.0


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
        },
    }


def test_many_services_reach_ready(
    kube_cluster: LocalCluster,
    kube_namespace: str,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    operator = start_operator(drift_interval=DRIFT_INTERVAL)
    baseline_mib = operator.peak_rss_mib()
    documents = [_document(i) for i in range(COUNT)]
    payload = "\n---\n".join(json.dumps(doc) for doc in documents)
    started = time.monotonic()
    kube_cluster.kubectl(
        "apply", "--server-side", "-n", kube_namespace, "-f", "-", input=payload, timeout=300
    )
    applied = time.monotonic() - started

    def ready_count() -> int:
        items = get_json(kube_cluster, "get", "infsvc", "-n", kube_namespace)["items"]
        return sum(condition(item, "Ready").get("status") == "True" for item in items)

    counts: list[int] = []

    def all_ready() -> bool:
        counts.append(ready_count())
        return counts[-1] == COUNT

    wait_for(f"{COUNT} InferenceServices Ready", all_ready, timeout=600, interval=2.0)
    elapsed = time.monotonic() - started
    peak_mib = operator.peak_rss_mib()
    deployments = get_json(kube_cluster, "get", "deployments", "-n", kube_namespace)["items"]
    assert len(deployments) == COUNT
    pods = get_json(kube_cluster, "get", "pods", "-n", kube_namespace)["items"]
    assert sum(condition(p, "Ready").get("status") == "True" for p in pods) == COUNT
    writes = operator.metric("davit_operator_child_writes_total")
    assert writes == 2 * COUNT, "one Deployment and one Service apply per object, no more"

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
        f"\nscale: {COUNT} InferenceServices (cpu, 1 replica, davit 0.1.0) on 5 KWOK nodes; "
        f"operator drift interval {DRIFT_INTERVAL} s; apply took {applied:.1f} s; "
        f"all Ready after {elapsed:.1f} s; operator peak RSS {peak_mib:.0f} MiB "
        f"(idle before: {baseline_mib:.0f} MiB); child writes {writes:.0f}; "
        f"idle {IDLE_SECONDS:.0f} s: {idle_ticks:.0f} timer reconciles, 0 writes, "
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
