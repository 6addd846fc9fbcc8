"""Authentication and authorization are real: service-account tokens and RBAC are enforced."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from davit_tools.devcluster import LocalCluster

pytestmark = pytest.mark.cluster


def test_service_account_token_is_authorized_only_after_a_role_binding(
    kube_cluster: LocalCluster, kube_namespace: str, tmp_path: Path
) -> None:
    ns = kube_namespace
    kube_cluster.kubectl("create", "serviceaccount", "reader", "-n", ns)
    token = kube_cluster.kubectl("create", "token", "reader", "-n", ns).stdout.strip()
    reader = kube_cluster.write_token_kubeconfig(token, tmp_path / "reader.kubeconfig")

    denied = kube_cluster.kubectl("get", "pods", "-n", ns, kubeconfig=reader, check=False)
    assert denied.returncode != 0
    assert f"system:serviceaccount:{ns}:reader" in denied.stderr
    assert "forbidden" in denied.stderr

    kube_cluster.kubectl(
        "create", "rolebinding", "reader-view", "-n", ns,
        "--clusterrole=view", f"--serviceaccount={ns}:reader",
    )  # fmt: skip
    # The RBAC authorizer reads bindings from an informer cache: allow it a moment to catch up.
    deadline = time.monotonic() + 15
    while True:
        allowed = kube_cluster.kubectl("get", "pods", "-n", ns, kubeconfig=reader, check=False)
        if allowed.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert allowed.returncode == 0, allowed.stderr
    # The view role grants no writes.
    write = kube_cluster.kubectl(
        "create", "configmap", "x", "-n", ns, "--from-literal=a=b", kubeconfig=reader, check=False
    )
    assert write.returncode != 0
    assert "forbidden" in write.stderr


def test_an_invalid_token_is_rejected(kube_cluster: LocalCluster, tmp_path: Path) -> None:
    bogus = kube_cluster.write_token_kubeconfig("not-a-token", tmp_path / "bogus.kubeconfig")
    result = kube_cluster.kubectl("get", "namespaces", kubeconfig=bogus, check=False)
    assert result.returncode != 0
    assert "Unauthorized" in result.stderr
