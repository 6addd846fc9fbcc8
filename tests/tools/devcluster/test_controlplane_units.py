"""Unit tests of the harness's pieces that need no running cluster."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from davit_tools.devcluster import DEFAULT_NODES, ClusterError, LocalCluster
from davit_tools.devcluster.certs import ClientIdentity, generate_pki
from davit_tools.devcluster.components import CLIENTS, Ports, component_specs
from davit_tools.devcluster.paths import pinned_versions
from davit_tools.devcluster.process import ProcessRecord, free_ports, process_start_ticks


@pytest.mark.parametrize("backend", ["cryptography", "openssl"])
def test_pki_chains_to_the_ca_with_kubernetes_identities(tmp_path: Path, backend: str) -> None:
    admin = ClientIdentity("admin", "davit-admin", ("system:masters",))
    pki = generate_pki(tmp_path, [admin], ["127.0.0.1", "10.96.0.1"], backend=backend)  # type: ignore[arg-type]

    front_proxy = pki.client_cert("front-proxy-client")
    separate = subprocess.run(
        ["openssl", "verify", "-CAfile", str(pki.ca_cert), str(front_proxy)],
        capture_output=True,
        text=True,
    )
    assert separate.returncode != 0, "the front proxy must not chain to the client CA"
    for ca, cert in (
        (pki.ca_cert, pki.serving_cert),
        (pki.ca_cert, pki.client_cert("admin")),
        (pki.front_proxy_ca_cert, front_proxy),
    ):
        verified = subprocess.run(
            ["openssl", "verify", "-CAfile", str(ca), str(cert)],
            capture_output=True,
            text=True,
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr

    client = x509.load_pem_x509_certificate(pki.client_cert("admin").read_bytes())
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "davit-admin"
    groups = [a.value for a in client.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert groups == ["system:masters"]
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]

    serving = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
    san = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert "kubernetes.default.svc" in san.get_values_for_type(x509.DNSName)

    assert oct(pki.ca_key.stat().st_mode & 0o777) == "0o600"
    assert pki.sa_public_key.read_text().startswith("-----BEGIN PUBLIC KEY-----")


def test_default_nodes_cover_every_accelerator_vendor() -> None:
    by_name = {n.name: n.manifest() for n in DEFAULT_NODES}
    resources = [set(m["status"]["capacity"]) for m in by_name.values()]
    assert sum("nvidia.com/gpu" in r for r in resources) == 2
    assert sum("amd.com/gpu" in r for r in resources) == 1
    assert sum("gpu.intel.com/i915" in r for r in resources) == 1
    assert sum(not any("gpu" in k for k in r) for r in resources) == 1
    for manifest in by_name.values():
        meta = manifest["metadata"]
        assert meta["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert meta["labels"]["type"] == "kwok"
        # No taint: ordinary workloads must schedule without tolerations.
        assert "taints" not in manifest["spec"]
        capacity, allocatable = manifest["status"]["capacity"], manifest["status"]["allocatable"]
        assert allocatable["pods"] == capacity["pods"]
        assert int(allocatable["cpu"].rstrip("m")) < int(capacity["cpu"]) * 1000


def test_free_ports_are_distinct_and_bindable_on_loopback() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_process_record_does_not_match_a_reused_pid() -> None:
    ticks = process_start_ticks(os.getpid())
    assert ticks is not None
    me = ProcessRecord("self", os.getpid(), ticks, "/dev/null", "")
    assert me.is_alive()
    # Same pid, different start time: what a recycled pid looks like to a stale state file.
    assert not ProcessRecord("self", os.getpid(), ticks + 1, "/dev/null", "").is_alive()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_start_ticks(child.pid) is None


def test_missing_binaries_are_reported_with_the_build_command(tmp_path: Path) -> None:
    cluster = LocalCluster(state_dir=tmp_path / "state", bin_dir=tmp_path / "bin")
    with pytest.raises(ClusterError, match=r"hack/controlplane/build\.sh"):
        cluster.start()
    with pytest.raises(ClusterError, match="not started"):
        _ = cluster.server


def test_stopping_a_cluster_that_never_started_touches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    bystander = tmp_path / "cluster.json"
    bystander.write_text("{}")
    LocalCluster(bin_dir=tmp_path / "bin").stop()
    assert bystander.exists()


def test_connect_rejects_a_kubeconfig_without_a_server(tmp_path: Path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    with pytest.raises(ClusterError, match="names no cluster server"):
        LocalCluster.connect(config)
    with pytest.raises(ClusterError, match="does not exist"):
        LocalCluster.connect(tmp_path / "absent")


def test_pins_are_exact_versions() -> None:
    versions = pinned_versions()
    assert versions.kubernetes.startswith("v1.35.")
    assert versions.etcd.startswith("v3.6.")
    assert versions.kwok == "v0.8.0"
    assert versions.kubernetes_minor == "1.35"


def test_importing_the_harness_does_not_import_torch() -> None:
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, davit_tools.devcluster.cli; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "False"


def test_every_listener_and_address_range_is_on_loopback(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path / "pki", list(CLIENTS), ["127.0.0.1"])
    specs = component_specs(tmp_path / "bin", tmp_path / "stages", tmp_path, pki, Ports.pick())
    assert [s.name for s in specs] == [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
    ]
    checked = 0
    for spec in specs:
        urls = [spec.health_url]
        for arg in spec.argv[1:]:
            flag, _, value = arg.partition("=")
            if flag == "--service-account-issuer":
                continue  # an identifier written into tokens, never dialled
            if "://" in value:
                urls += [u.split("=")[-1] for u in value.split(",")]
            elif flag in ("--bind-address", "--advertise-address", "--node-ip"):
                assert ipaddress.ip_address(value).is_loopback, arg
                checked += 1
            elif flag in ("--cidr", "--service-cluster-ip-range"):
                assert ipaddress.ip_network(value).subnet_of(ipaddress.ip_network("127.0.0.0/8"))
                checked += 1
            elif flag == "--server-address":
                assert value.startswith("127.0.0.1:"), arg
                checked += 1
        for url in urls:
            host = urlsplit(url).hostname
            assert host is not None and ipaddress.ip_address(host).is_loopback, (spec.name, url)
            checked += 1
    assert checked >= 20
