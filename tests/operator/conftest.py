"""Operator fixtures on the local control plane: the CRD, and the operator as a real process."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from davit_operator.api.crdgen import default_crd_path
from tests.operator.isvc_cluster import OperatorProcess
from tests.support import unavailable

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster


@pytest.fixture(scope="session")
def isvc_crd(kube_cluster: LocalCluster) -> str:
    """The generated CRD, installed and established."""
    kube_cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", str(default_crd_path())
    )
    kube_cluster.wait_established("crd/inferenceservices.serving.davit.dev")
    deadline = time.monotonic() + 30
    while kube_cluster.kubectl("get", "infsvc", "-A", check=False).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail("the API server did not serve inferenceservices within 30 s")
        time.sleep(0.2)
    return "inferenceservices.serving.davit.dev"


@pytest.fixture
def start_operator(
    kube_cluster: LocalCluster, kube_namespace: str, isvc_crd: str, tmp_path: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    """Factory: start (or restart) the operator for the test's namespace. At teardown the
    InferenceServices are deleted while an operator still runs (its finalizer must be released),
    then every operator started here is stopped."""
    started: list[OperatorProcess] = []

    def start(
        drift_interval: float = 2.0, all_namespaces: bool = False, memory_profiling: bool = False
    ) -> OperatorProcess:
        proc = OperatorProcess(
            kube_cluster,
            kube_namespace,
            tmp_path / "operator.log",
            drift_interval,
            all_namespaces,
            memory_profiling,
        )
        started.append(proc)
        return proc.start()

    yield start
    running = [p for p in started if p.process is not None and p.process.poll() is None]
    if running:
        kube_cluster.kubectl(
            "delete", "infsvc", "--all", "-n", kube_namespace, "--timeout=90s", check=False
        )
    else:
        # No operator to release the finalizers: drop them so the namespace can go.
        names = kube_cluster.kubectl(
            "get", "infsvc", "-n", kube_namespace, "-o", "name", check=False
        ).stdout.split()
        for name in names:
            kube_cluster.kubectl(
                "patch",
                name,
                "-n",
                kube_namespace,
                "--type=merge",
                "-p",
                json.dumps({"metadata": {"finalizers": None}}),
                check=False,
            )
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def gateway_crd_files() -> list[Path]:
    """The pinned Gateway API and Inference Extension CRD files (fetched into the cache from
    their Go modules when missing)."""
    from davit_tools.devcluster.gateway import GatewayCrdError, crd_files

    try:
        return crd_files()
    except GatewayCrdError as err:
        unavailable(f"the Gateway API CRDs: {err}")


def install_gateway_crds(cluster: LocalCluster, files: list[Path]) -> None:
    """Apply the CRD files and wait until the API server serves them."""
    for path in files:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    # Files are named GROUP_PLURAL.yaml; the CRDs PLURAL.GROUP.
    names = []
    for path in files:
        group, plural = path.name.removesuffix(".yaml").split("_", 1)
        names.append(f"crd/{plural}.{group}")
    cluster.wait_established(*names)
