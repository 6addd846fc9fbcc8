"""The operator the chart describes, run for real with exactly the chart's permissions.

KWOK pods run no containers, so the operator Deployment the chart installs never executes code.
These tests run `davit operator` as local processes instead, with the arguments the chart renders
and a token of the chart's ServiceAccount: any permission the chart forgot shows up as a failed
reconcile or a Forbidden line in the operator's log, and the peering object the chart creates is
the one the processes coordinate through."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from .test_chart_cluster import chart_crds, helm_install, notes_example, wait_available
from .tools import Helm

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
__all__ = ["chart_crds"]  # the fixture, imported for this module's tests

READY_TIMEOUT = 120.0
# A real memory profile of the engine for the NOTES example's shape on CPU (see the README in
# that folder); written as the profiling pod's termination message, as a kubelet would.
PROFILE = Path(__file__).resolve().parents[1] / "data" / "profiles" / "cpu-qwen3-0.6b.json"
PROFILE_IDENTITY_LABEL = "serving.davit.dev/profile-identity"


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(what: str, check: Callable[[], bool], timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def service_account_kubeconfig(
    cluster: LocalCluster, namespace: str, name: str, path: Path
) -> Path:
    token = cluster.kubectl(
        "create", "token", name, f"--namespace={namespace}", "--duration=3600s"
    ).stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    (entry,) = admin["clusters"]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [entry],
                "users": [{"name": name, "user": {"token": token}}],
                "contexts": [{"name": name, "context": {"cluster": entry["name"], "user": name}}],
                "current-context": name,
            }
        )
    )
    path.chmod(0o600)
    return path


@dataclass
class Release:
    """An installed chart release and what a local operator process needs to act as its pod."""

    name: str
    fullname: str
    namespace: str
    args: list[str]
    kubeconfig: Path


@dataclass
class LocalOperator:
    """`davit operator` as a local process with the chart's arguments, listeners on loopback
    (metrics off: its server binds every interface) and the ServiceAccount's credentials."""

    release: Release
    log: Path
    liveness_port: int
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, release: Release, log: Path, *extra: str) -> LocalOperator:
        port = free_loopback_port()
        kept = [a for a in release.args if not a.startswith(("--metrics-port", "--liveness"))]
        argv = [
            sys.executable,
            "-m",
            "davit_cli",
            "operator",
            *kept,
            "--metrics-port=0",
            f"--liveness=http://127.0.0.1:{port}/healthz",
            *extra,
        ]
        # KUBECONFIG is how the process finds its credentials (the pod uses in-cluster config).
        env = {**os.environ, "KUBECONFIG": str(release.kubeconfig)}
        with log.open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        return cls(release, log, port, proc)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def running(self) -> bool:
        """True while the process runs; fails the test (quoting the log) once it has exited,
        for example because it rejected one of the chart's arguments."""
        if not self.alive():
            pytest.fail(
                f"the operator exited with {self.proc.returncode}:\n{self.text()[-3000:]}",
                pytrace=False,
            )
        return True

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def text(self) -> str:
        return self.log.read_text()


@pytest.fixture
def operators(tmp_path: Path, releases: list[Release]) -> Iterator[list[LocalOperator]]:
    """Started operators; stopped afterwards (before their releases are uninstalled), with their
    logs shown when a test fails."""
    started: list[LocalOperator] = []
    yield started
    for op in started:
        op.stop()
        sys.stderr.write(f"--- {op.log.name} ---\n{op.text()[-4000:]}\n")


@pytest.fixture
def releases(kube_cluster: LocalCluster, helm: Helm) -> Iterator[list[Release]]:
    """Installed releases; uninstalled afterwards (before their namespace goes), so no
    cluster-scoped object of theirs outlives the test."""
    installed: list[Release] = []
    yield installed
    for release in installed:
        result = helm.run(
            "uninstall",
            release.name,
            f"--namespace={release.namespace}",
            kubeconfig=kube_cluster.kubeconfig,
        )
        assert result.returncode == 0, result.stderr


def install(
    helm: Helm,
    cluster: LocalCluster,
    namespace: str,
    tmp_path: Path,
    releases: list[Release],
    *set_args: str,
) -> Release:
    name = f"o{uuid.uuid4().hex[:8]}"
    fullname = f"{name}-davit"
    helm_install(helm, cluster, "install", name, namespace, *set_args)
    (container,) = wait_available(cluster, namespace, fullname)["spec"]["template"]["spec"][
        "containers"
    ]
    kubeconfig = service_account_kubeconfig(
        cluster, namespace, fullname, tmp_path / f"{fullname}.kubeconfig"
    )
    release = Release(name, fullname, namespace, container["args"], kubeconfig)
    releases.append(release)
    return release


def apply_notes_example(helm: Helm, cluster: LocalCluster, release: Release) -> str:
    notes = helm.run(
        "get",
        "notes",
        release.name,
        f"--namespace={release.namespace}",
        kubeconfig=cluster.kubeconfig,
    )
    assert notes.returncode == 0, notes.stderr
    example = yaml.safe_load(notes_example(notes.stdout))
    cluster.kubectl(
        "apply", f"--namespace={release.namespace}", "-f", "-", input=json.dumps(example)
    )
    return str(example["metadata"]["name"])


def complete_profiling(cluster: LocalCluster, namespace: str, op: LocalOperator) -> None:
    """Play the kubelet for the memory-profiling Job the operator starts: KWOK marks its pod
    Succeeded without running it; the engine would leave its profile as the termination
    message."""

    def finished_pod() -> bool:
        op.running()
        jobs = cluster.kubectl_json(
            "get", "jobs", f"--namespace={namespace}", "-l", PROFILE_IDENTITY_LABEL
        )
        if not jobs["items"]:
            return False
        job = jobs["items"][0]["metadata"]["name"]
        pods = cluster.kubectl_json(
            "get", "pods", f"--namespace={namespace}", "-l", f"job-name={job}"
        )
        done = [p for p in pods["items"] if p["status"].get("phase") == "Succeeded"]
        finished.extend(p["metadata"]["name"] for p in done[:1])
        return bool(done)

    finished: list[str] = []
    wait_for("the profiling Job's pod to finish", finished_pod, 60)
    terminated = {"exitCode": 0, "reason": "Completed", "message": PROFILE.read_text().strip()}
    status = {
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {
                    "name": "engine",
                    "image": "engine",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ],
        }
    }
    cluster.kubectl(
        "patch",
        "pod",
        finished[0],
        f"--namespace={namespace}",
        "--subresource=status",
        "--type=merge",
        "--patch",
        json.dumps(status),
    )


def inference_service(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = cluster.kubectl_json(
        "get", "inferenceservice", name, f"--namespace={namespace}"
    )
    return obj


def is_ready(obj: dict[str, Any]) -> bool:
    status = obj.get("status") or {}
    ready = [c for c in status.get("conditions") or [] if c["type"] == "Ready"]
    return (
        bool(ready)
        and ready[0]["status"] == "True"
        and status.get("observedGeneration") == obj["metadata"]["generation"]
    )


def peers(cluster: LocalCluster, release: Release, cluster_wide: bool) -> dict[str, Any]:
    if cluster_wide:
        obj = cluster.kubectl_json("get", "clusterkopfpeering", release.fullname)
    else:
        obj = cluster.kubectl_json(
            "get", "kopfpeering", release.fullname, f"--namespace={release.namespace}"
        )
    return dict(obj.get("status") or {})


def assert_no_permission_errors(op: LocalOperator) -> None:
    text = op.text()
    assert "Forbidden" not in text and "Not enough permissions" not in text, text[-3000:]


@pytest.mark.parametrize("mode", ["cluster-wide", "single-namespace"])
def test_operator_reconciles_the_notes_example_with_the_chart_rbac(
    kube_cluster: LocalCluster,
    kube_namespace: str,
    chart_crds: None,
    helm: Helm,
    tmp_path: Path,
    operators: list[LocalOperator],
    releases: list[Release],
    mode: str,
) -> None:
    cluster, ns = kube_cluster, kube_namespace
    cluster_wide = mode == "cluster-wide"
    release = install(
        helm, cluster, ns, tmp_path, releases, *([] if cluster_wide else [f"watchNamespace={ns}"])
    )
    op = LocalOperator.start(release, tmp_path / "operator.log")
    operators.append(op)

    name = apply_notes_example(helm, cluster, release)
    complete_profiling(cluster, ns, op)
    wait_for(
        f"{name} to become Ready",
        lambda: op.running() and is_ready(inference_service(cluster, ns, name)),
    )
    # The profile went into a ConfigMap (create/patch rights) and sized the engine's KV cache.
    (stored,) = cluster.kubectl_json(
        "get", "configmaps", f"--namespace={ns}", "-l", PROFILE_IDENTITY_LABEL
    )["items"]
    assert stored["data"]

    # kopf's liveness endpoint answers where the chart's probes look for it.
    with urllib.request.urlopen(f"http://127.0.0.1:{op.liveness_port}/healthz", timeout=5) as r:
        assert r.status == 200
    # The children the NOTES rely on: a Service on port 8000 in front of a Deployment.
    service = cluster.kubectl_json("get", "service", name, f"--namespace={ns}")
    assert [p["port"] for p in service["spec"]["ports"]] == [8000]
    child = cluster.kubectl_json("get", "deployment", name, f"--namespace={ns}")
    (owner,) = child["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("InferenceService", name)
    # The operator joined the peering object the chart made (one live peer: itself).
    assert len(peers(cluster, release, cluster_wide)) == 1

    # Deleted while the operator runs, so it can release its finalizer.
    cluster.kubectl("delete", "inferenceservice", name, f"--namespace={ns}", "--timeout=60s")
    op.stop()
    assert_no_permission_errors(op)


def test_peering_elects_one_operator_and_hands_over(
    kube_cluster: LocalCluster,
    kube_namespace: str,
    chart_crds: None,
    helm: Helm,
    tmp_path: Path,
    operators: list[LocalOperator],
    releases: list[Release],
) -> None:
    """Two replicas (or the old and new pod of a rolling update) in one peering: the one with
    the higher priority reconciles, the other stands by and takes over once it leaves."""
    cluster, ns = kube_cluster, kube_namespace
    release = install(helm, cluster, ns, tmp_path, releases, f"watchNamespace={ns}")
    # Replicas draw random priorities; fixed ones here make the leader known in advance.
    leader = LocalOperator.start(release, tmp_path / "leader.log", "--priority=200")
    operators.append(leader)
    name = apply_notes_example(helm, cluster, release)
    complete_profiling(cluster, ns, leader)
    wait_for(
        f"{name} to become Ready",
        lambda: leader.running() and is_ready(inference_service(cluster, ns, name)),
    )

    standby = LocalOperator.start(release, tmp_path / "standby.log", "--priority=100")
    operators.append(standby)
    wait_for("both operators in the peering", lambda: len(peers(cluster, release, False)) == 2)
    # An operator starts paused and resumes once peering shows no live peer above it: the
    # standby never resumes while the leader lives.
    time.sleep(5)
    assert "Resuming operations" not in standby.text()

    def scale_to(replicas: int, operator: LocalOperator) -> None:
        cluster.kubectl(
            "patch",
            "inferenceservice",
            name,
            f"--namespace={ns}",
            "--type=merge",
            "--patch",
            json.dumps({"spec": {"replicas": replicas}}),
        )
        wait_for(
            f"{name} scaled to {replicas}",
            lambda: (
                operator.running()
                and cluster.kubectl_json("get", "deployment", name, f"--namespace={ns}")["spec"][
                    "replicas"
                ]
                == replicas
                and is_ready(inference_service(cluster, ns, name))
            ),
        )

    # The leader keeps reconciling while the standby is alive.
    scale_to(2, leader)
    assert "Pausing" not in leader.text()
    assert "Resuming operations" not in standby.text()

    leader.stop()
    wait_for("the leader to leave the peering", lambda: len(peers(cluster, release, False)) == 1)
    scale_to(1, standby)
    assert "Resuming operations after the pause" in standby.text()

    cluster.kubectl("delete", "inferenceservice", name, f"--namespace={ns}", "--timeout=60s")
    standby.stop()
    assert_no_permission_errors(leader)
    assert_no_permission_errors(standby)
