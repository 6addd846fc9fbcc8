"""A real metrics pipeline for the autoscaling test: Prometheus and prometheus-adapter on loopback.

- `Prometheus` discovers the engine pods through the local API server (`kubernetes_sd_configs`,
  role pod, limited to the test's namespace) with the scrape job of docs/autoscaling.md, and
  scrapes them at the loopback pod addresses the engine kubelet stand-in gives them
  (127.65.x.y:8000, the pod IP and the container port named `http`, as in a cluster).
- `MetricsAdapter` runs prometheus-adapter with the rules of docs/autoscaling.md and registers it
  as the aggregated API `custom.metrics.k8s.io/v1beta2` (an APIService on a Service). The API
  server reaches an aggregated API through its Service's ClusterIP; ClusterIPs of the local
  control plane are loopback addresses (127.96.0.0/16) that nothing routes, so the adapter listens
  on its Service's ClusterIP and port itself, where kube-proxy would forward in a cluster (an
  EndpointSlice marks it ready, as the EndpointSlice controller does for a ready pod). Its
  serving certificate names the Service (`NAME.NAMESPACE.svc`) and is verified by the API server
  through the APIService's `caBundle`. The kube-controller-manager's HPA controller reads the
  metrics through the API server, as everywhere.

Both binaries are built by hack/metrics/build.sh (run by hack/install.sh) into the cache outside
the repository.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from davit_tools.devcluster.certs import generate_serving_pair
from tests.support import unavailable

from .model_store import cache_root
from .sources import free_port

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

# Keep in step with hack/metrics/{prometheus,adapter}/go.mod.
PROMETHEUS_VERSION = "v0.316.0"
ADAPTER_VERSION = "v0.12.0"
CUSTOM_METRICS = "custom.metrics.k8s.io"
CUSTOM_METRICS_VERSION = "v1beta2"
APISERVICE = f"{CUSTOM_METRICS_VERSION}.{CUSTOM_METRICS}"
ADAPTER_SERVICE = "custom-metrics-apiserver"
SCRAPE_INTERVAL_S = 2
# The adapter lists the series it can serve this often; a new pod's series is served after it.
RELIST_INTERVAL_S = 5

# docs/autoscaling.md, "The metrics pipeline", step 2: the rules as the user installs them.
ADAPTER_RULES: list[dict[str, Any]] = [
    {
        "seriesQuery": (
            '{__name__=~"vllm:(num_requests_waiting|kv_cache_usage_perc)",namespace!="",pod!=""}'
        ),
        "resources": {
            "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        },
        "name": {"matches": "^vllm:(.*)$", "as": "vllm_${1}"},
        "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }
]


def engine_scrape_job(namespace: str) -> dict[str, Any]:
    """docs/autoscaling.md, step 1: the scrape job, limited to one namespace (a test's)."""
    return {
        "job_name": "davit-engines",
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [namespace]}}],
        "relabel_configs": [
            {
                "source_labels": ["__meta_kubernetes_pod_label_serving_davit_dev_inferenceservice"],
                "regex": ".+",
                "action": "keep",
            },
            {
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "regex": "http",
                "action": "keep",
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    }


def binary(name: str, version: str, file: str) -> Path:
    path = cache_root() / "metrics" / name / version / file
    if not path.is_file():
        unavailable(f"{name} {version} is not built at {path} (hack/metrics/build.sh)")
    return path


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _client_files(kubeconfig: Path, work: Path) -> dict[str, str]:
    """The admin kubeconfig's CA and client certificate as files, for Prometheus' tls_config."""
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    user = config["users"][0]["user"]
    files = {
        "ca_file": cluster["certificate-authority-data"],
        "cert_file": user["client-certificate-data"],
        "key_file": user["client-key-data"],
    }
    out = {}
    for key, data in files.items():
        path = work / f"apiserver-{key}.pem"
        path.write_bytes(base64.b64decode(data))
        path.chmod(0o600)
        out[key] = str(path)
    return out


@dataclass
class Prometheus:
    """Prometheus scraping the engine pods of `namespace`, found through the API server."""

    cluster: LocalCluster
    namespace: str
    work: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        exe = binary("prometheus", PROMETHEUS_VERSION, "prometheus")
        self.work.mkdir(parents=True, exist_ok=True)
        job = engine_scrape_job(self.namespace)
        job["kubernetes_sd_configs"][0] |= {
            "api_server": self.cluster.server,
            "tls_config": _client_files(self.cluster.kubeconfig, self.work),
        }
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
            },
            "scrape_configs": [job],
        }
        config_file = self.work / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        log = self.work / "prometheus.log"
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    str(exe),
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={self.work / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=2h",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus did not become ready: {log.read_text()[-3000:]}")
            time.sleep(0.3)
        return self

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        answer.raise_for_status()
        result: list[dict[str, Any]] = answer.json()["data"]["result"]
        return result

    def active_targets(self) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/api/v1/targets", params={"state": "active"}, timeout=10)
        answer.raise_for_status()
        targets: list[dict[str, Any]] = answer.json()["data"]["activeTargets"]
        return targets

    def stop(self) -> None:
        _stop(self.process)


@dataclass
class MetricsAdapter:
    """prometheus-adapter serving `custom.metrics.k8s.io/v1beta2` through the API server."""

    cluster: LocalCluster
    namespace: str  # where its Service lives
    prometheus_url: str
    work: Path
    process: subprocess.Popen[bytes] | None = None
    registered: bool = False

    def start(self, timeout: float = 120.0) -> MetricsAdapter:
        exe = binary("prometheus-adapter", ADAPTER_VERSION, "adapter")
        self.work.mkdir(parents=True, exist_ok=True)
        cluster_ip, port = self._service()
        dns = f"{ADAPTER_SERVICE}.{self.namespace}.svc"
        tls = generate_serving_pair(self.work / "tls", "adapter", [dns], [cluster_ip])
        config_file = self.work / "adapter-rules.yaml"
        config_file.write_text(yaml.safe_dump({"rules": ADAPTER_RULES}, sort_keys=False))
        kubeconfig = str(self.cluster.kubeconfig)
        log = self.work / "adapter.log"
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    str(exe),
                    f"--prometheus-url={self.prometheus_url}",
                    f"--config={config_file}",
                    f"--metrics-relist-interval={RELIST_INTERVAL_S}s",
                    f"--bind-address={cluster_ip}",
                    f"--secure-port={port}",
                    f"--tls-cert-file={tls.cert}",
                    f"--tls-private-key-file={tls.key}",
                    f"--lister-kubeconfig={kubeconfig}",
                    f"--authentication-kubeconfig={kubeconfig}",
                    f"--authorization-kubeconfig={kubeconfig}",
                    "--v=1",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._register(port, tls.ca_cert)
        deadline = time.monotonic() + timeout
        while not self._available():
            if self.process.poll() is not None or time.monotonic() > deadline:
                status = self.cluster.kubectl(
                    "get", "apiservice", APISERVICE, "-o", "json", check=False
                ).stdout
                raise RuntimeError(
                    f"{APISERVICE} did not become Available within {timeout} s: {status[-1500:]}"
                    f"\nadapter log:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        return self

    def _service(self) -> tuple[str, int]:
        """The adapter's Service (no selector: the adapter answers on the ClusterIP itself)."""
        port = free_port()
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ADAPTER_SERVICE, "namespace": self.namespace},
            "spec": {"ports": [{"name": "https", "port": port, "protocol": "TCP"}]},
        }
        # The API server's availability check wants a ready endpoint with the port's name (it
        # routes through the ClusterIP all the same). The EndpointSlice controller is off here
        # and loopback addresses are refused in EndpointSlices, so the slice names the Service's
        # own DNS name, the address a client reaches the adapter by.
        endpoints = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": ADAPTER_SERVICE,
                "namespace": self.namespace,
                "labels": {
                    "kubernetes.io/service-name": ADAPTER_SERVICE,
                    "endpointslice.kubernetes.io/managed-by": "davit-e2e",
                },
            },
            "addressType": "FQDN",
            "endpoints": [
                {
                    "addresses": [f"{ADAPTER_SERVICE}.{self.namespace}.svc"],
                    "conditions": {"ready": True},
                }
            ],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        }
        manifest = {"apiVersion": "v1", "kind": "List", "items": [service, endpoints]}
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        obj = self.cluster.kubectl_json("get", "service", ADAPTER_SERVICE, "-n", self.namespace)
        cluster_ip = str(obj["spec"]["clusterIP"])
        # The ClusterIP is on loopback, where this port may already be taken on another address
        # only: binding the exact address is what must work.
        with socket.socket() as probe:
            probe.bind((cluster_ip, port))
        return cluster_ip, int(obj["spec"]["ports"][0]["port"])

    def _register(self, port: int, ca_cert: Path) -> None:
        apiservice = {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": APISERVICE},
            "spec": {
                "group": CUSTOM_METRICS,
                "version": CUSTOM_METRICS_VERSION,
                "service": {"namespace": self.namespace, "name": ADAPTER_SERVICE, "port": port},
                "caBundle": base64.b64encode(ca_cert.read_bytes()).decode(),
                "groupPriorityMinimum": 100,
                "versionPriority": 200,
            },
        }
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(apiservice))
        self.registered = True

    def _available(self) -> bool:
        obj = self.cluster.kubectl_json("get", "apiservice", APISERVICE)
        for cond in obj.get("status", {}).get("conditions", []):
            if cond["type"] == "Available":
                return bool(cond["status"] == "True")
        return False

    def pods_metric(self, namespace: str, metric: str) -> dict[str, float]:
        """`kubectl get --raw` of a Pods metric for every pod of `namespace`: pod -> value."""
        path = (
            f"/apis/{CUSTOM_METRICS}/{CUSTOM_METRICS_VERSION}/namespaces/"
            f"{urllib.parse.quote(namespace)}/pods/*/{metric}"
        )
        result = self.cluster.kubectl("get", "--raw", path, check=False)
        if result.returncode != 0:
            return {}
        items = json.loads(result.stdout).get("items", [])
        return {item["describedObject"]["name"]: _quantity(item["value"]) for item in items}

    def stop(self) -> None:
        # An APIService whose server is gone makes discovery fail for the whole cluster (and
        # namespace deletion wait), so it goes first.
        if self.registered:
            self.cluster.kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found")
            self.registered = False
        _stop(self.process)


def _quantity(text: str) -> float:
    """A Kubernetes quantity as the metrics API writes values (`3`, `1500m`)."""
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)
