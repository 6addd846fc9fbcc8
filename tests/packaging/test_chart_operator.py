"""The operator the chart describes, run for real with exactly the chart's permissions.

KWOK pods run no containers, so the operator Deployment the chart installs never executes code.
This test runs `davit operator` as a local process instead, with the arguments the chart renders
and a token of the chart's ServiceAccount, applies the InferenceService from NOTES.txt and waits
until the operator reports it Ready: any permission the chart forgot shows up as a failed
reconcile or a Forbidden line in the operator's log."""

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
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from .test_chart_cluster import chart_crds, helm_install, notes_example, wait_available
from .tools import Helm

if TYPE_CHECKING:
    from davit_operator.devcluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
__all__ = ["chart_crds"]  # the fixture, imported for this module's tests

READY_TIMEOUT = 120.0


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


def local_args(chart_args: list[str], liveness_port: int) -> list[str]:
    """The chart's arguments with the listeners moved to loopback (metrics off: its server
    binds every interface)."""
    kept = [a for a in chart_args if not a.startswith(("--metrics-port", "--liveness"))]
    return [*kept, "--metrics-port=0", f"--liveness=http://127.0.0.1:{liveness_port}/healthz"]


@pytest.fixture
def operator_log(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "operator.log"
    yield path
    if path.exists():
        sys.stderr.write(f"--- operator log ({path}) ---\n{path.read_text()[-4000:]}\n")


def conditions(obj: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions") or []}


@pytest.mark.parametrize("mode", ["cluster-wide", "single-namespace"])
def test_operator_reconciles_the_notes_example_with_the_chart_rbac(
    kube_cluster: LocalCluster,
    kube_namespace: str,
    chart_crds: None,
    helm: Helm,
    tmp_path: Path,
    operator_log: Path,
    mode: str,
) -> None:
    cluster, ns = kube_cluster, kube_namespace
    release = f"o{uuid.uuid4().hex[:8]}"
    fullname = f"{release}-davit"
    set_args = [f"watchNamespace={ns}"] if mode == "single-namespace" else []
    helm_install(helm, cluster, "install", release, ns, *set_args)
    deployment = wait_available(cluster, ns, fullname)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    kubeconfig = service_account_kubeconfig(cluster, ns, fullname, tmp_path / "sa.kubeconfig")
    liveness_port = free_loopback_port()

    # KUBECONFIG is how the chart's pod would find credentials too (in-cluster config aside).
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    with operator_log.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "davit_engine.cli",
                "operator",
                *local_args(container["args"], liveness_port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        notes = helm.run(
            "get", "notes", release, f"--namespace={ns}", kubeconfig=cluster.kubeconfig
        )
        assert notes.returncode == 0, notes.stderr
        example = yaml.safe_load(notes_example(notes.stdout))
        name = example["metadata"]["name"]
        cluster.kubectl("apply", f"--namespace={ns}", "-f", "-", input=json.dumps(example))

        deadline = time.monotonic() + READY_TIMEOUT
        isvc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the operator exited with {proc.returncode}"
            isvc = cluster.kubectl_json("get", "inferenceservice", name, f"--namespace={ns}")
            status = isvc.get("status") or {}
            if (
                conditions(isvc).get("Ready") == "True"
                and status.get("observedGeneration") == isvc["metadata"]["generation"]
            ):
                break
            time.sleep(1)
        else:
            pytest.fail(f"{name} did not become Ready: {json.dumps(isvc.get('status'))}")

        # kopf's liveness endpoint answers where the chart's probes look for it.
        with urllib.request.urlopen(f"http://127.0.0.1:{liveness_port}/healthz", timeout=5) as r:
            assert r.status == 200

        # The children the NOTES rely on: a Service on port 8000 in front of a Deployment.
        service = cluster.kubectl_json("get", "service", name, f"--namespace={ns}")
        assert [p["port"] for p in service["spec"]["ports"]] == [8000]
        child = cluster.kubectl_json("get", "deployment", name, f"--namespace={ns}")
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("InferenceService", name)

        # The operator joined the peering object the chart made (one live peer: itself).
        if mode == "cluster-wide":
            peering = cluster.kubectl_json("get", "clusterkopfpeering", fullname)
        else:
            peering = cluster.kubectl_json("get", "kopfpeering", fullname, f"--namespace={ns}")
        assert len(peering.get("status") or {}) == 1, peering

        # Deleted while the operator runs, so it can release its finalizer.
        cluster.kubectl(
            "delete", "inferenceservice", name, f"--namespace={ns}", "--timeout=60s", timeout=90
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    log_text = operator_log.read_text()
    assert "Forbidden" not in log_text and "Not enough permissions" not in log_text, log_text[
        -3000:
    ]
