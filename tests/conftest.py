"""Fixtures shared by every test folder: the local Kubernetes control plane.

Nothing here runs unless a test requests ``kube_cluster`` or ``kube_namespace``; the cluster starts
once per session on first use (about ten seconds) and stops at the end. Set ``DAVIT_KUBECONFIG`` to
the kubeconfig of a running cluster (for example the one printed by
``python -m davit_tools.devcluster up``) to reuse it instead.
"""

from __future__ import annotations

import os

# Before anything imports torch or a kernel module, whichever folder is collected first: OpenMP
# spin-waiting slows multi-threaded torch ops on shared cores, and Triton picks its interpreter
# when a kernel module is imported, so a CPU-only machine must choose it here (an e2e or tools
# module collected before tests/engine may import the engine's kernels).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import re
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A running control plane with KWOK fake nodes (see davit_tools.devcluster.nodes)."""
    from davit_tools.devcluster import ClusterError, LocalCluster
    from davit_tools.devcluster.paths import reuse_kubeconfig

    reuse = reuse_kubeconfig()
    if reuse is not None:
        cluster = LocalCluster.connect(reuse)
        ready = cluster.kubectl("get", "--raw=/readyz", check=False)
        if ready.returncode != 0:
            pytest.fail(
                f"DAVIT_KUBECONFIG={reuse} does not reach a ready API server "
                f"({ready.stderr.strip()}); start one with "
                "`python -m davit_tools.devcluster up` or unset DAVIT_KUBECONFIG",
                pytrace=False,
            )
        yield cluster
        return
    cluster = LocalCluster(state_dir=tmp_path_factory.mktemp("kube-cluster"))
    try:
        cluster.start()
    except ClusterError as err:
        pytest.fail(f"the local control plane did not start: {err}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def kube_namespace(kube_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test, deleted afterwards.

    Teardown waits until the namespace's pods are gone, so the fake nodes' GPUs are free again
    before the next test schedules pods.
    """
    stopped = kube_cluster.stopped_components()
    if stopped:
        pytest.fail(
            "the local control plane lost "
            + ", ".join(f"{r.name} (log: {r.log})" for r in stopped)
            + "; later cluster tests in this session will fail too",
            pytrace=False,
        )
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"t-{stem}-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", name)
    kube_cluster.kubectl("label", "namespace", name, "davit.dev/test=true")
    # Pods are refused until the ServiceAccount controller has created "default".
    deadline = time.monotonic() + 30
    while kube_cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail(f"namespace {name} got no default ServiceAccount within 30 s")
        time.sleep(0.2)
    yield name
    # The namespace controller starts deleting a namespace's content only 5 s after the request
    # (a fixed grace period). What the next test needs is this one's pods gone and their GPUs
    # free, so delete the workloads directly first and wait for the pods only.
    kube_cluster.kubectl(
        "delete",
        "deployments.apps,statefulsets.apps,daemonsets.apps,jobs.batch,replicasets.apps,pods",
        "--all",
        "-n",
        name,
        "--wait=false",
        check=False,
    )
    kube_cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false")
    deadline = time.monotonic() + 90
    while kube_cluster.kubectl("get", "pods", "-n", name, "-o", "name").stdout.strip():
        if time.monotonic() > deadline:
            pytest.fail(f"pods in namespace {name} were not deleted within 90 s")
        time.sleep(0.2)
