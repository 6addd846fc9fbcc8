"""Fixtures for the end-to-end rollout tests: the control plane, the CRD, the operator, an
engine kubelet stand-in with a PersistentVolume holding the SmolLM2 GGUF, one namespace."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

from davit_operator.api.crdgen import default_crd_path
from tests.support import reference_gguf

from .kubelet import EngineKubelet, cpu_engine_limits, host_path_claim
from .sources import free_port

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NODE = "engine-kubelet-0"
CLAIM = "models"


@dataclass
class E2E:
    cluster: LocalCluster
    namespace: str
    kubelet: EngineKubelet
    log_dir: Path

    def kubectl_json(self, *args: str) -> Any:
        out = self.cluster.kubectl(*args, "-n", self.namespace, "-o", "json").stdout
        return json.loads(out)

    def apply(self, doc: dict[str, Any]) -> None:
        self.cluster.kubectl(
            "apply", "--server-side", "-n", self.namespace, "-f", "-", input=yaml.safe_dump(doc)
        )

    def isvc(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.kubectl_json("get", "infsvc", name)
        return obj

    def events(self, name: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.kubectl_json(
            "get", "events", "--field-selector", f"involvedObject.name={name}"
        )["items"]
        return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")


@pytest.fixture(scope="module")
def e2e(kube_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    gguf = reference_gguf()
    work = tmp_path_factory.mktemp("e2e")
    models = work / "models"
    (models / "smollm2").mkdir(parents=True)
    (models / "smollm2" / GGUF).symlink_to(gguf)
    logs = work / "logs"
    logs.mkdir()
    namespace = f"e2e-rollout-{uuid.uuid4().hex[:6]}"
    pv = f"{namespace}-models"

    kube_cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", str(default_crd_path())
    )
    kube_cluster.wait_established("crd/inferenceservices.serving.davit.dev")
    kube_cluster.kubectl("create", "namespace", namespace)
    volume = host_path_claim(pv, namespace, CLAIM, models, "1Gi", "ReadOnlyMany")
    kube_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(volume))
    deadline = time.monotonic() + 60
    while (
        kube_cluster.kubectl_json("get", "pvc", CLAIM, "-n", namespace)["status"].get("phase")
        != "Bound"
    ):
        if time.monotonic() > deadline:
            pytest.fail("the models claim was not bound within 60 s")
        time.sleep(0.5)
    # Pods are refused until the ServiceAccount controller has created "default".
    while kube_cluster.kubectl("get", "sa", "default", "-n", namespace, check=False).returncode:
        time.sleep(0.2)

    kubelet = EngineKubelet(kube_cluster.kubeconfig, NODE, logs).start()
    liveness = free_port()
    operator_log = (logs / "operator.log").open("ab")
    operator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "davit_cli",
            "operator",
            "--namespace",
            namespace,
            "--kubeconfig",
            str(kube_cluster.kubeconfig),
            "--metrics-port",
            str(free_port()),
            "--liveness",
            f"http://127.0.0.1:{liveness}/healthz",
            "--drift-interval",
            "1",
            "--no-memory-profiling",
        ],
        stdout=operator_log,
        stderr=subprocess.STDOUT,
    )
    env = E2E(kube_cluster, namespace, kubelet, logs)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{liveness}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if operator.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the operator did not start: {(logs / 'operator.log').read_text()}")
            time.sleep(0.2)
        yield env
    finally:
        # Delete while the operator runs (its finalizer), then stop everything started here.
        kube_cluster.kubectl(
            "delete", "infsvc", "--all", "-n", namespace, "--wait=false", check=False
        )
        deadline = time.monotonic() + 30
        while kube_cluster.kubectl_json("get", "infsvc", "-n", namespace)["items"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        operator.terminate()
        try:
            operator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
        operator_log.close()
        kubelet.stop()
        kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        kube_cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


def base_spec(replicas: int, rollout: dict[str, Any]) -> dict[str, Any]:
    """A CPU InferenceService of SmolLM2 from the models claim, placed on the engine kubelet."""
    return {
        "model": {
            "source": f"pvc://{CLAIM}/smollm2",
            "file": GGUF,
            "servedName": "smol",
        },
        "engine": {"type": "davit", "version": "0.1.0"},
        "limits": cpu_engine_limits(),
        "accelerator": {"vendor": "cpu"},
        "replicas": replicas,
        "pod": {"nodeSelector": {"kubernetes.io/hostname": NODE}},
        "rollout": rollout,
    }


def document(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": spec,
    }
