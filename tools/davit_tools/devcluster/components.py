"""What each control-plane process is: its command line, health endpoint and identity.

Pure functions of the layout (binaries, state folder, certificates, ports): no process is started
here, so the loopback-only promise can be checked without running anything.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .certs import FRONT_PROXY_CLIENT, ClientIdentity, Pki
from .nodes import KWOK_ANNOTATION, KWOK_ANNOTATION_VALUE
from .paths import STAGE_FILES
from .process import free_ports

LOOPBACK = "127.0.0.1"
# Pod addresses stay on loopback so nothing a test does can reach a real network.
POD_CIDR = "127.64.0.0/16"
NODE_IP = LOOPBACK
# ClusterIPs are only allocated, never routed (there is no kube-proxy); keeping them on loopback
# means a client that tries one anyway cannot reach another machine.
SERVICE_CIDR = "127.96.0.0/16"
FIRST_SERVICE_IP = "127.96.0.1"
NODE_LEASE_SECONDS = 40

ADMIN = ClientIdentity("admin", "davit-admin", ("system:masters",))
CONTROLLER_MANAGER = ClientIdentity("kube-controller-manager", "system:kube-controller-manager")
SCHEDULER = ClientIdentity("kube-scheduler", "system:kube-scheduler")
# kwok acts as the kubelet of every fake node at once; the Node authorizer admits one node per
# identity, so kwok runs with cluster-admin rights instead.
KWOK = ClientIdentity("kwok", "kwok-controller", ("system:masters",))
CLIENTS = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, KWOK)


@dataclass(frozen=True)
class Ports:
    """One loopback port per listener."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int

    @classmethod
    def pick(cls) -> Ports:
        return cls(*free_ports(6))


@dataclass(frozen=True)
class ComponentSpec:
    """How to run and probe one process.

    ``tls`` says how its health endpoint is verified: ``cluster`` with the cluster CA and the admin
    client certificate, ``self-signed`` for the certificate the component generates itself.
    ``healthy_body`` is a text the health answer must contain, if any.
    """

    name: str
    argv: tuple[str, ...]
    health_url: str
    tls: Literal["none", "cluster", "self-signed"]
    healthy_body: str | None = None


def kubeconfig_path(state_dir: Path, identity: ClientIdentity) -> Path:
    name = "kubeconfig" if identity is ADMIN else f"{identity.file_stem}.kubeconfig"
    return state_dir / name


def kubeconfig(server: str, pki: Pki, identity: ClientIdentity) -> dict[str, Any]:
    """A self-contained kubeconfig (certificates embedded) for one client identity."""

    def data(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "davit-local",
                "cluster": {"server": server, "certificate-authority-data": data(pki.ca_cert)},
            }
        ],
        "users": [
            {
                "name": identity.user,
                "user": {
                    "client-certificate-data": data(pki.client_cert(identity.file_stem)),
                    "client-key-data": data(pki.client_key(identity.file_stem)),
                },
            }
        ],
        "contexts": [
            {"name": "davit-local", "context": {"cluster": "davit-local", "user": identity.user}}
        ],
        "current-context": "davit-local",
    }


def component_specs(
    bin_dir: Path, stage_dir: Path, state_dir: Path, pki: Pki, ports: Ports
) -> list[ComponentSpec]:
    """The five processes in start order (each needs the ones before it)."""
    etcd_url = f"http://{LOOPBACK}:{ports.etcd_client}"
    peer_url = f"http://{LOOPBACK}:{ports.etcd_peer}"
    kcm_config = kubeconfig_path(state_dir, CONTROLLER_MANAGER)
    scheduler_config = kubeconfig_path(state_dir, SCHEDULER)
    return [
        ComponentSpec(
            "etcd",
            (
                str(bin_dir / "etcd"),
                "--name=davit",
                f"--data-dir={state_dir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=davit={peer_url}",
                # A throwaway cluster: durability is not worth an fsync per write.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ),
            f"{etcd_url}/health",
            "none",
            healthy_body='"health":"true"',
        ),
        ComponentSpec(
            "kube-apiserver",
            (
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={ports.apiserver}",
                f"--advertise-address={LOOPBACK}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--service-account-key-file={pki.sa_public_key}",
                f"--service-account-signing-key-file={pki.sa_private_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                # Front-proxy settings publish the request-header CA in
                # kube-system/extension-apiserver-authentication; without them the controller
                # manager and scheduler log an error every few seconds, and aggregated API servers
                # could not authenticate the API server.
                f"--requestheader-client-ca-file={pki.front_proxy_ca_cert}",
                f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki.client_cert(FRONT_PROXY_CLIENT)}",
                f"--proxy-client-key-file={pki.client_key(FRONT_PROXY_CLIENT)}",
                "--allow-privileged=true",
                "--profiling=false",
                # The API server would write the "kubernetes" Service's endpoints with its
                # advertise address, which endpoint validation rejects on loopback.
                "--endpoint-reconciler-type=none",
                "--v=1",
            ),
            f"https://{LOOPBACK}:{ports.apiserver}/readyz",
            "cluster",
        ),
        ComponentSpec(
            "kube-controller-manager",
            (
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kcm_config}",
                f"--authentication-kubeconfig={kcm_config}",
                f"--authorization-kubeconfig={kcm_config}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={ports.controller_manager}",
                f"--cert-dir={state_dir / 'kube-controller-manager'}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.sa_private_key}",
                f"--root-ca-file={pki.ca_cert}",
                f"--cluster-signing-cert-file={pki.ca_cert}",
                f"--cluster-signing-key-file={pki.ca_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Endpoint validation rejects loopback addresses, so with loopback pod IPs these
                # controllers could only retry failing writes and flood the log and events.
                "--controllers=*,-endpoints-controller,-endpointslice-controller,"
                "-endpointslice-mirroring-controller",
                "--profiling=false",
                "--v=1",
            ),
            f"https://{LOOPBACK}:{ports.controller_manager}/healthz",
            "self-signed",
        ),
        ComponentSpec(
            "kube-scheduler",
            (
                str(bin_dir / "kube-scheduler"),
                f"--kubeconfig={scheduler_config}",
                f"--authentication-kubeconfig={scheduler_config}",
                f"--authorization-kubeconfig={scheduler_config}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={ports.scheduler}",
                f"--cert-dir={state_dir / 'kube-scheduler'}",
                "--leader-elect=false",
                "--profiling=false",
                "--v=1",
            ),
            f"https://{LOOPBACK}:{ports.scheduler}/healthz",
            "self-signed",
        ),
        ComponentSpec(
            "kwok",
            (
                str(bin_dir / "kwok"),
                f"--kubeconfig={kubeconfig_path(state_dir, KWOK)}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_ANNOTATION_VALUE}",
                f"--cidr={POD_CIDR}",
                f"--node-ip={NODE_IP}",
                f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
                f"--server-address={LOOPBACK}:{ports.kwok}",
                *(f"--config={stage_dir / name}" for name in STAGE_FILES),
            ),
            f"http://{LOOPBACK}:{ports.kwok}/healthz",
            "none",
        ),
    ]
