"""Rolling updates on the local control plane (KWOK pods, no engines): pause and resume, and a
revision whose replicas never become ready rolled back at its progress deadline."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.operator.isvc_cluster import apply_yaml, wait_for
from tests.operator.isvc_helpers import merge

pytestmark = pytest.mark.cluster

SPEC: dict[str, Any] = {
    "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"},
    "engine": {"type": "davit", "version": "0.1.0"},
    "accelerator": {"vendor": "cpu"},
    "replicas": 2,
    "limits": {"kvCacheMemoryBytes": 64 << 20},
    "pod": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
    "rollout": {"rolling": {"maxSurge": 1, "maxUnavailable": 0}, "progressDeadlineSeconds": 10},
}


def isvc(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "r"},
        "spec": spec,
    }


def get(cluster: Any, namespace: str, kind: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json").stdout
    result: dict[str, Any] = json.loads(out)
    return result


def phase(cluster: Any, namespace: str) -> str | None:
    rollout = get(cluster, namespace, "infsvc", "r").get("status", {}).get("rollout") or {}
    value = rollout.get("phase")
    return str(value) if value else None


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


def test_pause_holds_a_rolling_update_and_resume_completes_it(
    kube_cluster: Any, kube_namespace: str, start_operator: Any
) -> None:
    start_operator(drift_interval=1.0)
    apply_yaml(kube_cluster, kube_namespace, [isvc(SPEC)])
    wait_for("stable", lambda: phase(kube_cluster, kube_namespace) == "Complete" or None, 60)
    paused = merge(SPEC, {"limits": {"maxNumSeqs": 8}, "rollout": {"paused": True}})
    apply_yaml(kube_cluster, kube_namespace, [isvc(paused)])
    wait_for("paused", lambda: phase(kube_cluster, kube_namespace) == "Paused" or None, 30)
    deployment = get(kube_cluster, kube_namespace, "deployment", "r")
    assert deployment["spec"]["paused"] is True
    obj = get(kube_cluster, kube_namespace, "infsvc", "r")
    assert condition(obj, "RolloutProgressing")["status"] == "Unknown"
    assert [r["outcome"] for r in obj["status"]["revisions"]] == ["Succeeded", "Progressing"]

    apply_yaml(kube_cluster, kube_namespace, [isvc(merge(paused, {"rollout": {"paused": False}}))])
    wait_for("complete", lambda: phase(kube_cluster, kube_namespace) == "Complete" or None, 60)
    obj = get(kube_cluster, kube_namespace, "infsvc", "r")
    assert [r["outcome"] for r in obj["status"]["revisions"]] == ["Succeeded", "Succeeded"]
    assert "--max-num-seqs" in obj["status"]["revisions"][-1]["engineArgs"]
    assert "paused" not in get(kube_cluster, kube_namespace, "deployment", "r")["spec"]


def test_a_revision_that_never_gets_ready_is_rolled_back_at_its_deadline(
    kube_cluster: Any, kube_namespace: str, start_operator: Any
) -> None:
    start_operator(drift_interval=1.0)
    apply_yaml(kube_cluster, kube_namespace, [isvc(SPEC)])
    wait_for("stable", lambda: phase(kube_cluster, kube_namespace) == "Complete" or None, 60)
    good_args = get(kube_cluster, kube_namespace, "deployment", "r")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    # The claim does not exist: the new replica stays Pending, the old ones keep serving.
    stuck = merge(SPEC, {"model": {"source": "pvc://missing-claim/model", "revision": None}})
    apply_yaml(kube_cluster, kube_namespace, [isvc(stuck)])
    wait_for("rolled back", lambda: phase(kube_cluster, kube_namespace) == "RolledBack" or None, 90)
    obj = get(kube_cluster, kube_namespace, "infsvc", "r")
    record = obj["status"]["revisions"][-1]
    assert (record["outcome"], record["reason"]) == ("RolledBack", "ProgressDeadlineExceeded")
    stalled = condition(obj, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "RolledBack")
    assert "ProgressDeadlineExceeded" in condition(obj, "RolloutProgressing")["message"]

    def restored() -> bool | None:
        spec = get(kube_cluster, kube_namespace, "deployment", "r")["spec"]["template"]["spec"]
        return spec["containers"][0]["args"] == good_args or None

    wait_for("stable template back on the Deployment", restored, 30)
    events = json.loads(
        kube_cluster.kubectl(
            "get", "events", "-n", kube_namespace, "--field-selector", "involvedObject.name=r",
            "-o", "json",
        ).stdout
    )["items"]  # fmt: skip
    assert any(e["reason"] == "RolledBack" and e["type"] == "Warning" for e in events)


CANARY = merge(
    SPEC,
    {
        "replicas": 2,
        "rollout": {
            "strategy": "Canary",
            "canary": {"steps": [{"weight": 50, "pauseSeconds": 5}]},
            "progressDeadlineSeconds": 600,
        },
    },
)


def test_canary_pause_resume_and_abort_on_the_cluster(
    kube_cluster: Any, kube_namespace: str, start_operator: Any
) -> None:
    """KWOK pods run no engine: the canary gets no reading and waits at its step, which is
    enough to see pause, resume and an abort (the spec reverted) act on the real objects."""
    start_operator(drift_interval=1.0)
    apply_yaml(kube_cluster, kube_namespace, [isvc(CANARY)])
    wait_for("stable", lambda: phase(kube_cluster, kube_namespace) == "Complete" or None, 60)
    changed = merge(CANARY, {"limits": {"maxNumSeqs": 8}})
    apply_yaml(kube_cluster, kube_namespace, [isvc(changed)])

    def canary_replicas() -> tuple[int, int] | None:
        found = kube_cluster.kubectl(
            "get", "deployment", "r-canary", "-n", kube_namespace, "-o", "json", check=False
        )
        if found.returncode != 0:
            return None  # not created yet
        canary = json.loads(found.stdout)
        stable = get(kube_cluster, kube_namespace, "deployment", "r")
        return (canary["spec"]["replicas"], stable["spec"]["replicas"])

    assert wait_for("canary Deployment", canary_replicas, 30) == (1, 1)
    obj = get(kube_cluster, kube_namespace, "infsvc", "r")
    assert obj["status"]["rollout"]["weight"] == 50
    assert obj["status"]["rollout"]["routing"] == "ReplicaRatio"
    assert condition(obj, "Reconciling")["status"] == "True"

    apply_yaml(kube_cluster, kube_namespace, [isvc(merge(changed, {"rollout": {"paused": True}}))])
    wait_for("paused", lambda: phase(kube_cluster, kube_namespace) == "Paused" or None, 30)
    obj = get(kube_cluster, kube_namespace, "infsvc", "r")
    assert condition(obj, "RolloutProgressing")["status"] == "Unknown"
    assert canary_replicas() == (1, 1)
    apply_yaml(kube_cluster, kube_namespace, [isvc(changed)])
    wait_for("resumed", lambda: phase(kube_cluster, kube_namespace) == "Progressing" or None, 30)

    # Reverting the spec aborts the canary: its Deployment goes, the stable one is whole again.
    apply_yaml(kube_cluster, kube_namespace, [isvc(CANARY)])
    wait_for("complete", lambda: phase(kube_cluster, kube_namespace) == "Complete" or None, 30)

    def canary_gone() -> bool | None:
        names = kube_cluster.kubectl(
            "get", "deployments", "-n", kube_namespace, "-o", "name"
        ).stdout.split()
        return names == ["deployment.apps/r"] or None

    wait_for("canary Deployment deleted", canary_gone, 30)
    assert get(kube_cluster, kube_namespace, "deployment", "r")["spec"]["replicas"] == 2
    obj = get(kube_cluster, kube_namespace, "infsvc", "r")
    assert [r["outcome"] for r in obj["status"]["revisions"]] == ["Succeeded", "Superseded"]
    events = json.loads(
        kube_cluster.kubectl(
            "get", "events", "-n", kube_namespace, "--field-selector", "involvedObject.name=r",
            "-o", "json",
        ).stdout
    )["items"]  # fmt: skip
    reasons = {e["reason"] for e in events}
    assert {"RolloutStarted", "Paused", "Resumed", "RolloutAborted"} <= reasons
