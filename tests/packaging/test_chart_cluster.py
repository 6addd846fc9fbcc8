"""The chart against the local control plane (real API server, KWOK nodes playing the kubelets):
server-side dry runs of the rendered objects, and a full install / upgrade / uninstall cycle."""

from __future__ import annotations

import json
import re
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from .tools import CHART, Helm

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CRD_NAMES = (
    "clusterkopfpeerings.kopf.dev",
    "inferenceservices.serving.davit.dev",
    "kopfpeerings.kopf.dev",
)


@pytest.fixture(scope="module")
def chart_crds(kube_cluster: LocalCluster) -> None:
    """The chart's CRDs, installed the way helm does before any template (and left installed,
    as helm leaves them)."""
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    kube_cluster.wait_established(*(f"crd/{n}" for n in CRD_NAMES))


@pytest.fixture
def second_namespace(kube_cluster: LocalCluster, kube_namespace: str) -> Iterator[str]:
    name = f"{kube_namespace[:50]}-w"
    kube_cluster.kubectl("create", "namespace", name)
    yield name
    kube_cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--timeout=90s")


def release_name() -> str:
    # Cluster-scoped objects (ClusterRole, ClusterKopfPeering) carry the release name: unique
    # per test so tests never share them.
    return f"d{uuid.uuid4().hex[:8]}"


def can_i(
    cluster: LocalCluster, service_account: str, verb: str, resource: str, namespace: str | None
) -> bool:
    args = ["auth", "can-i", verb, resource, f"--as=system:serviceaccount:{service_account}"]
    args.append(f"--namespace={namespace}" if namespace else "--all-namespaces")
    result = cluster.kubectl(*args, check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), result.stderr
    return answer == "yes"


@pytest.mark.parametrize("mode", ["cluster-wide", "single-namespace"])
def test_rendered_chart_passes_server_side_dry_run(
    kube_cluster: LocalCluster,
    kube_namespace: str,
    second_namespace: str,
    chart_crds: None,
    helm: Helm,
    mode: str,
) -> None:
    set_args = ["metrics.serviceMonitor.enabled=false"]
    if mode == "single-namespace":
        set_args.append(f"watchNamespace={second_namespace}")
    rendered = helm.run(
        *helm.template_args(
            *set_args, release=release_name(), namespace=kube_namespace, include_crds=True
        )
    )
    assert rendered.returncode == 0, rendered.stderr
    result = kube_cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", "-o", "json", input=rendered.stdout
    )
    applied = json.loads(result.stdout)
    kinds = sorted(item["kind"] for item in applied["items"])
    expected = [
        "ClusterRole",
        "ClusterRoleBinding",
        *["CustomResourceDefinition"] * len(CRD_NAMES),
        "Deployment",
        "Service",
        "ServiceAccount",
    ]
    if mode == "single-namespace":
        expected += ["Role", "RoleBinding", "KopfPeering"]
    else:
        expected += ["ClusterKopfPeering"]
    assert kinds == sorted(expected)


def helm_install(
    helm: Helm, cluster: LocalCluster, command: str, release: str, namespace: str, *set_args: str
) -> None:
    result = helm.run(
        command,
        release,
        str(CHART),
        f"--namespace={namespace}",
        "--wait=watcher",
        "--timeout=180s",
        *(f"--set={s}" for s in set_args),
        kubeconfig=cluster.kubeconfig,
    )
    assert result.returncode == 0, f"helm {command} failed:\n{result.stdout}\n{result.stderr}"


def deployment(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = cluster.kubectl_json("get", "deployment", name, "-n", namespace)
    return obj


def wait_available(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    cluster.kubectl(
        "rollout", "status", f"deployment/{name}", "-n", namespace, "--timeout=120s", timeout=150
    )
    obj = deployment(cluster, namespace, name)
    conditions = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert conditions["Available"] == "True"
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert obj["status"]["updatedReplicas"] == obj["spec"]["replicas"]
    return obj


def notes_example(notes: str) -> str:
    """The InferenceService manifest embedded in NOTES.txt."""
    match = re.search(r"<<'YAML'\n(.*?)\n\s*YAML\n", notes, re.S)
    assert match, notes
    return textwrap.dedent(match.group(1))


def test_install_upgrade_uninstall(
    kube_cluster: LocalCluster,
    kube_namespace: str,
    second_namespace: str,
    chart_crds: None,
    helm: Helm,
    tmp_path: Path,
) -> None:
    cluster, ns = kube_cluster, kube_namespace
    release = release_name()
    fullname = f"{release}-davit"
    sa = f"{ns}:{fullname}"

    helm_install(helm, cluster, "install", release, ns)
    installed = wait_available(cluster, ns, fullname)
    (container,) = installed["spec"]["template"]["spec"]["containers"]
    assert "--all-namespaces" in container["args"]
    assert f"--peering={fullname}" in container["args"]
    pods = cluster.kubectl_json(
        "get", "pods", "-n", ns, "-l", "app.kubernetes.io/instance=" + release
    )
    assert [p["status"]["phase"] for p in pods["items"]] == ["Running"]
    assert pods["items"][0]["spec"]["serviceAccountName"] == fullname
    cluster.kubectl("get", "clusterkopfpeering", fullname)
    cluster.kubectl("get", "service", f"{fullname}-metrics", "-n", ns)

    # The API server's own authorizer agrees with the least-privilege intent, cluster-wide.
    elsewhere = second_namespace
    assert can_i(cluster, sa, "patch", "inferenceservices.serving.davit.dev", elsewhere)
    assert can_i(cluster, sa, "patch", "inferenceservices.serving.davit.dev/status", elsewhere)
    assert can_i(cluster, sa, "create", "deployments.apps", elsewhere)
    assert can_i(cluster, sa, "list", "nodes", None)
    assert can_i(cluster, sa, "patch", f"clusterkopfpeerings.kopf.dev/{fullname}", None)
    assert not can_i(cluster, sa, "patch", "clusterkopfpeerings.kopf.dev/someone-else", None)
    assert not can_i(cluster, sa, "update", "deployments.apps", elsewhere)
    assert not can_i(cluster, sa, "get", "secrets", elsewhere)
    assert not can_i(cluster, sa, "create", "inferenceservices.serving.davit.dev", elsewhere)
    assert not can_i(cluster, sa, "delete", "nodes", None)

    # The example in NOTES.txt is a valid InferenceService for this API server.
    notes = helm.run("get", "notes", release, f"--namespace={ns}", kubeconfig=cluster.kubeconfig)
    assert notes.returncode == 0, notes.stderr
    example = yaml.safe_load(notes_example(notes.stdout))
    assert example["kind"] == "InferenceService"
    cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump(example))

    # Upgrade: new flags roll out, and single-namespace mode narrows the permissions.
    helm_install(
        helm,
        cluster,
        "upgrade",
        release,
        ns,
        "driftIntervalSeconds=45",
        "verbose=true",
        f"watchNamespace={ns}",
    )
    upgraded = wait_available(cluster, ns, fullname)
    (container,) = upgraded["spec"]["template"]["spec"]["containers"]
    assert "--drift-interval=45" in container["args"]
    assert "--verbose" in container["args"]
    assert f"--namespace={ns}" in container["args"]
    assert "--all-namespaces" not in container["args"]
    assert upgraded["metadata"]["generation"] > installed["metadata"]["generation"]
    history = helm.run(
        "history", release, f"--namespace={ns}", "-o", "json", kubeconfig=cluster.kubeconfig
    )
    assert [r["status"] for r in json.loads(history.stdout)] == ["superseded", "deployed"]
    assert can_i(cluster, sa, "patch", "inferenceservices.serving.davit.dev", ns)
    assert not can_i(cluster, sa, "patch", "inferenceservices.serving.davit.dev", elsewhere)
    assert not can_i(cluster, sa, "create", "deployments.apps", elsewhere)
    assert can_i(cluster, sa, "list", "nodes", None)
    # The peering moved with the operator's scope: a KopfPeering in the watched namespace.
    assert can_i(cluster, sa, "patch", f"kopfpeerings.kopf.dev/{fullname}", ns)
    assert not can_i(cluster, sa, "patch", f"clusterkopfpeerings.kopf.dev/{fullname}", None)
    cluster.kubectl("get", "kopfpeering", fullname, f"--namespace={ns}")
    assert cluster.kubectl("get", "clusterkopfpeering", fullname, "--ignore-not-found").stdout == ""

    # Uninstall removes every object the chart made, and leaves the CRDs (and so every
    # InferenceService) in place, as helm does with crds/.
    result = helm.run(
        "uninstall",
        release,
        f"--namespace={ns}",
        "--wait",
        "--timeout=120s",
        kubeconfig=cluster.kubeconfig,
    )
    assert result.returncode == 0, result.stderr
    for kind, name, namespaced in [
        ("deployment", fullname, True),
        ("serviceaccount", fullname, True),
        ("service", f"{fullname}-metrics", True),
        ("role", fullname, True),
        ("rolebinding", fullname, True),
        ("clusterrole", fullname, False),
        ("clusterrolebinding", fullname, False),
        ("kopfpeering", fullname, True),
    ]:
        args = ["get", kind, name, "--ignore-not-found", "-o", "name"]
        if namespaced:
            args.append(f"--namespace={ns}")
        assert cluster.kubectl(*args).stdout.strip() == "", f"{kind}/{name} survived uninstall"
    for crd in CRD_NAMES:
        cluster.kubectl("get", "crd", crd)
