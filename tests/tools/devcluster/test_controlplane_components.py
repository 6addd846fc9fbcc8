"""The built binaries and the running control plane: versions, health, fake nodes."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
from typing import Any

import pytest
from kubernetes.utils import parse_quantity

from davit_tools.devcluster import DEFAULT_NODES, LocalCluster, pinned_versions

pytestmark = pytest.mark.cluster

VERSIONS = pinned_versions()


def test_api_server_reports_the_stamped_version(kube_cluster: LocalCluster) -> None:
    reported = kube_cluster.kubectl_json("version")
    server, client = reported["serverVersion"], reported["clientVersion"]
    major, minor = VERSIONS.kubernetes_minor.split(".")
    assert server["gitVersion"] == VERSIONS.kubernetes
    assert (server["major"], server["minor"]) == (major, minor)
    # kubectl is stamped through client-go's version package as well.
    assert client["gitVersion"] == VERSIONS.kubernetes
    assert (client["major"], client["minor"]) == (major, minor)


@pytest.mark.parametrize(
    ("binary", "expected"),
    [
        ("kube-apiserver", f"Kubernetes {VERSIONS.kubernetes}"),
        ("kube-controller-manager", f"Kubernetes {VERSIONS.kubernetes}"),
        ("kube-scheduler", f"Kubernetes {VERSIONS.kubernetes}"),
        ("etcd", f"etcd Version: {VERSIONS.etcd.lstrip('v')}"),
        ("kwok", f"kwok version v{VERSIONS.kwok.lstrip('v')}"),
    ],
)
def test_each_binary_reports_its_pinned_version(
    kube_cluster: LocalCluster, binary: str, expected: str
) -> None:
    out = subprocess.run(
        [str(kube_cluster.bin_dir / binary), "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert expected in out.stdout + out.stderr


def test_every_component_is_healthy(kube_cluster: LocalCluster) -> None:
    verbose = kube_cluster.kubectl("get", "--raw=/readyz?verbose").stdout
    assert "readyz check passed" in verbose
    assert "[+]etcd ok" in verbose
    assert "[+]poststarthook/rbac/bootstrap-roles ok" in verbose
    for record in kube_cluster.processes:
        assert record.is_alive(), f"{record.name} is not running; see {record.log}"


def _node(kube_cluster: LocalCluster, name: str) -> Any:
    return kube_cluster.kubectl_json("get", "node", name)


@pytest.mark.parametrize("fake", DEFAULT_NODES, ids=lambda n: n.name)
def test_fake_node_is_ready_with_its_capacity_and_labels(
    kube_cluster: LocalCluster, fake: Any
) -> None:
    node = _node(kube_cluster, fake.name)
    wanted = fake.manifest()
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions["Ready"] == "True"
    # The API server stores quantities in canonical form ("2048Gi" reads back as "2Ti").
    for field in ("capacity", "allocatable"):
        got = {k: parse_quantity(v) for k, v in node["status"][field].items()}
        assert got == {k: parse_quantity(v) for k, v in wanted["status"][field].items()}, field
    for key, value in wanted["metadata"]["labels"].items():
        assert node["metadata"]["labels"].get(key) == value, key
    assert not node["spec"].get("taints"), "fake nodes must accept pods without tolerations"
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert ipaddress.ip_address(addresses["InternalIP"]).is_loopback
    # KWOK renews a Lease per node, which the node lifecycle controller reads as the heartbeat.
    lease = kube_cluster.kubectl_json("get", "lease", fake.name, "-n", "kube-node-lease")
    renewed = datetime.datetime.fromisoformat(lease["spec"]["renewTime"])
    age = datetime.datetime.now(datetime.UTC) - renewed
    assert age.total_seconds() < lease["spec"]["leaseDurationSeconds"], lease["spec"]


def test_accelerator_labels_match_the_usual_device_plugin_labels(
    kube_cluster: LocalCluster,
) -> None:
    h200 = kube_cluster.kubectl(
        "get", "nodes", "-l", "nvidia.com/gpu.product=NVIDIA-H200", "-o", "name"
    ).stdout.split()
    assert h200 == ["node/gpu-h200-0", "node/gpu-h200-1"]
    for name in ("gpu-h200-0", "gpu-h200-1"):
        labels = _node(kube_cluster, name)["metadata"]["labels"]
        assert labels["nvidia.com/gpu.memory"] == "143771"
        assert labels["nvidia.com/gpu.count"] == "8"
    mi300x = _node(kube_cluster, "gpu-mi300x-0")
    assert mi300x["status"]["capacity"]["amd.com/gpu"] == "8"
    assert mi300x["metadata"]["labels"]["amd.com/gpu.product-name"].startswith(
        "AMD_Instinct_MI300X"
    )
    xpu = _node(kube_cluster, "gpu-max1550-0")
    assert xpu["status"]["capacity"]["gpu.intel.com/i915"] == "8"
    assert xpu["metadata"]["labels"]["intel.feature.node.kubernetes.io/gpu"] == "true"
    cpu = _node(kube_cluster, "cpu-0")
    assert not [k for k in cpu["status"]["capacity"] if "gpu" in k]


def test_env_lets_a_subprocess_use_plain_kubectl(kube_cluster: LocalCluster) -> None:
    env = kube_cluster.env({"PATH": "/usr/bin:/bin"})
    assert env["PATH"].split(":")[0] == str(kube_cluster.bin_dir)
    out = subprocess.run(
        ["kubectl", "get", "nodes", "-o", "name"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert len(out.stdout.split()) == len(DEFAULT_NODES)
