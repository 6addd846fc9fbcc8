"""`helm lint` and `helm template` of charts/davit: what the chart renders in each mode."""

from __future__ import annotations

import json
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from .tools import CHART, KUBE_VERSION, REPO, Helm, Permission, find, only, permissions

# Children are written by server-side apply (PATCH; create for new objects) and never PUT.
WORKLOAD = {"create", "get", "list", "watch", "patch", "delete"}
READ = {"get", "list", "watch"}


def triples(group: str, resource: str, verbs: set[str]) -> set[Permission]:
    return {(group, resource, verb) for verb in verbs}


# Exactly what the operator does where InferenceServices live, and nothing more.
NAMESPACED: set[Permission] = (
    triples("serving.davit.dev", "inferenceservices", READ | {"patch"})
    | triples("serving.davit.dev", "inferenceservices/status", {"get", "patch"})
    | triples("apps", "deployments", WORKLOAD)
    | triples("", "services", WORKLOAD)
    | triples("policy", "poddisruptionbudgets", WORKLOAD)
    | triples("batch", "jobs", WORKLOAD)
    | triples("", "configmaps", {"get", "create", "patch"})
    # spec.autoscaling's HPA; spec.routing's InferencePool and HTTPRoute (the operator's own
    # HTTPRoutes are watched and applied; a user's canary route is read and patched).
    | triples("autoscaling", "horizontalpodautoscalers", WORKLOAD)
    | triples("inference.networking.k8s.io", "inferencepools", WORKLOAD)
    | triples("gateway.networking.k8s.io", "httproutes", WORKLOAD)
    | triples("", "pods", READ)
    | triples("", "events", {"create", "patch"})
)
CLUSTER_READS: set[Permission] = triples("", "nodes", READ) | triples(
    "apiextensions.k8s.io", "customresourcedefinitions", READ
)
NAMESPACE_READS: set[Permission] = triples("", "namespaces", {"list", "watch"})
CLUSTER_PEERING: set[Permission] = triples("kopf.dev", "clusterkopfpeerings", READ | {"patch"})
NAMESPACE_PEERING: set[Permission] = triples("kopf.dev", "kopfpeerings", READ | {"patch"})


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = only(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("mode", [[], ["watchNamespace=team-a"], ["leaderElection.enabled=false"]])
def test_helm_lint_strict(helm: Helm, mode: list[str]) -> None:
    result = helm.run(
        "lint",
        str(CHART),
        "--strict",
        f"--kube-version={KUBE_VERSION}",
        *(f"--set={s}" for s in mode),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_chart_versions_match_the_project() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "operator" / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # An empty tag means "the appVersion", so the default install runs the matching operator.
    assert values["image"]["tag"] == ""


def test_cluster_wide_rbac_is_exactly_the_needed_set(helm: Helm) -> None:
    objects = helm.template()
    assert find(objects, "Role") == []
    cluster_role = only(objects, "ClusterRole", "davit")
    assert permissions(cluster_role["rules"]) == NAMESPACED | CLUSTER_READS | CLUSTER_PEERING
    binding = only(objects, "ClusterRoleBinding", "davit")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "davit",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "davit", "namespace": "davit-system"}
    ]
    args = operator_container(objects)["args"]
    assert "--all-namespaces" in args
    assert not any(a.startswith("--namespace") for a in args)


def test_single_namespace_rbac_grants_namespaced_rights_only_there(helm: Helm) -> None:
    objects = helm.template("watchNamespace=team-a")
    cluster_role = only(objects, "ClusterRole", "davit")
    # Only cluster-scoped reads stay cluster-wide: a Role cannot grant nodes, CRDs or namespaces
    # (which a namespaced kopf operator lists to learn that its namespace exists).
    assert permissions(cluster_role["rules"]) == CLUSTER_READS | NAMESPACE_READS
    roles = {o["metadata"]["namespace"]: o for o in find(objects, "Role")}
    assert permissions(roles["team-a"]["rules"]) == NAMESPACED | NAMESPACE_PEERING
    (binding,) = [b for b in find(objects, "RoleBinding") if b["metadata"]["namespace"] == "team-a"]
    assert binding["roleRef"]["kind"] == "Role"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "davit", "namespace": "davit-system"}
    ]
    args = operator_container(objects)["args"]
    assert "--namespace=team-a" in args
    assert "--all-namespaces" not in args


@pytest.mark.parametrize(
    ("mode", "kind", "role_kind", "namespace"),
    [
        ([], "ClusterKopfPeering", "ClusterRole", None),
        (["watchNamespace=team-a"], "KopfPeering", "Role", "team-a"),
    ],
)
def test_peering_matches_the_operator_scope(
    helm: Helm, mode: list[str], kind: str, role_kind: str, namespace: str | None
) -> None:
    # kopf picks the peering kind from the operator's scope: cluster-wide peering for
    # --all-namespaces, a KopfPeering in the served namespace for --namespace.
    objects = helm.template(*mode, release="prod")
    peering = only(objects, kind)
    assert peering["apiVersion"] == "kopf.dev/v1"
    assert peering["metadata"]["name"] == "prod-davit"
    assert peering["metadata"].get("namespace") == namespace
    plural = kind.lower() + "s"
    rules = [r for r in only(objects, role_kind)["rules"] if r["resources"] == [plural]]
    by_verbs = {tuple(sorted(r["verbs"])): r for r in rules}
    # Writes are limited to the release's own object; the kind is only listed and watched.
    assert sorted(by_verbs) == [("get", "patch"), ("list", "watch")]
    assert by_verbs[("get", "patch")]["resourceNames"] == ["prod-davit"]
    assert "resourceNames" not in by_verbs[("list", "watch")]
    assert "--peering=prod-davit" in operator_container(objects)["args"]


def test_no_peering_without_leader_election(helm: Helm) -> None:
    objects = helm.template("leaderElection.enabled=false")
    rules = [
        rule for o in find(objects, "Role") + find(objects, "ClusterRole") for rule in o["rules"]
    ]
    assert not {p for p in permissions(rules) if p[0] == "kopf.dev"}
    assert find(objects, "ClusterKopfPeering") == []
    assert (
        find(helm.template("leaderElection.enabled=false", "watchNamespace=a"), "KopfPeering") == []
    )
    deployment = only(objects, "Deployment")
    assert not any(a.startswith("--peering") for a in operator_container(objects)["args"])
    # Without peering an update must not run two operators side by side.
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("mode", [[], ["watchNamespace=team-a"]])
def test_no_wildcards_in_any_rule(helm: Helm, mode: list[str]) -> None:
    objects = helm.template(*mode)
    rbac = find(objects, "Role") + find(objects, "ClusterRole")
    assert rbac, "the chart rendered no RBAC"
    for obj in rbac:
        for rule in obj["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(key, []), (obj["metadata"]["name"], rule)
            assert "nonResourceURLs" not in rule
            # Neither secrets nor RBAC objects: the operator never needs them.
            assert not {"secrets", "roles", "clusterroles", "rolebindings"} & set(rule["resources"])


def test_no_rbac_when_disabled(helm: Helm) -> None:
    objects = helm.template("rbac.create=false")
    for kind in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"):
        assert find(objects, kind) == []


def test_operator_runs_non_root_with_a_read_only_root(helm: Helm) -> None:
    objects = helm.template()
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = operator_container(objects)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "privileged" not in security or security["privileged"] is False
    # The read-only root needs a writable scratch folder for Python.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert container["resources"]["requests"]["cpu"]
    assert container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]


def test_probes_hit_the_liveness_endpoint_port(helm: Helm) -> None:
    container = operator_container(helm.template("health.port=9440"))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == 9440
    for probe in ("livenessProbe", "readinessProbe"):
        http = container[probe]["httpGet"]
        assert http["port"] in ("health", 9440)
        assert http["path"] == "/healthz"
    # kopf serves its liveness endpoint where --liveness says; the probes must call the same.
    assert "--liveness=http://0.0.0.0:9440/healthz" in container["args"]


def test_replicas_and_leader_election(helm: Helm) -> None:
    objects = helm.template()
    deployment = only(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    # The new pod starts before the old one stops; peering keeps only one of them active.
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    args = operator_container(objects)["args"]
    assert "--peering=davit" in args
    assert "--drift-interval=10" in args
    assert "--verbose" not in args
    assert "--verbose" in operator_container(helm.template("verbose=true"))["args"]


def test_image_defaults_to_app_version_and_pins_a_digest(helm: Helm) -> None:
    assert operator_container(helm.template())["image"] == "ghcr.io/davit-dev/davit-operator:0.1.0"
    digest = "sha256:" + "ab" * 32
    image = operator_container(
        helm.template("image.repository=registry.test/davit/operator", f"image.digest={digest}")
    )["image"]
    assert image == f"registry.test/davit/operator:0.1.0@{digest}"


def test_metrics_service_selects_the_operator_pods(helm: Helm) -> None:
    objects = helm.template("metrics.port=9090", "metrics.service.port=8443")
    service = only(objects, "Service", "davit-metrics")
    deployment = only(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port == {"name": "metrics", "port": 8443, "targetPort": "metrics", "protocol": "TCP"}
    container = operator_container(objects)
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert "--metrics-port=9090" in container["args"]
    assert find(objects, "ServiceMonitor") == []


def test_service_monitor_scrapes_the_metrics_service(helm: Helm) -> None:
    objects = helm.template(
        "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom"
    )
    monitor = only(objects, "ServiceMonitor")
    service = only(objects, "Service", "davit-metrics")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["davit-system"]}


def test_service_monitor_without_the_service_fails_clearly(helm: Helm) -> None:
    result = helm.run(
        *helm.template_args("metrics.serviceMonitor.enabled=true", "metrics.service.enabled=false")
    )
    assert result.returncode != 0
    assert "metrics.service.enabled" in result.stderr


def test_every_namespaced_object_lands_in_its_namespace(helm: Helm) -> None:
    objects = helm.template("watchNamespace=team-a", namespace="ops")
    cluster_scoped = {
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "ClusterKopfPeering",
    }
    for obj in objects:
        if obj["kind"] in cluster_scoped:
            assert "namespace" not in obj["metadata"]
        elif obj["kind"] in ("Role", "RoleBinding", "KopfPeering"):
            assert obj["metadata"]["namespace"] in ("ops", "team-a")
        else:
            assert obj["metadata"]["namespace"] == "ops", obj["kind"]


def test_extra_args_and_env_reach_the_container(helm: Helm, tmp_path: Path) -> None:
    container = operator_container(
        helm.template(
            values={
                "extraArgs": ["--some-flag=1"],
                "extraEnv": [{"name": "DAVIT_CATALOG", "value": "/etc/davit/catalog"}],
            },
            values_dir=tmp_path,
        )
    )
    assert container["args"][-1] == "--some-flag=1"
    assert {"name": "DAVIT_CATALOG", "value": "/etc/davit/catalog"} in container["env"]


def test_model_delivery_values_become_operator_flags(helm: Helm, tmp_path: Path) -> None:
    """The cache claim, endpoints and fetch settings are chart values; the operator's own
    parser reads the rendered arguments back."""
    from davit_operator.cli import _operator_parser

    default = operator_container(helm.template())
    parsed = _operator_parser().parse_args(default["args"])
    assert parsed.model_cache is None and parsed.hf_endpoint is None
    # The fetch Jobs run the image the chart installs, wherever it comes from.
    assert parsed.fetch_image == default["image"]
    container = operator_container(
        helm.template(
            values={
                "image": {"repository": "registry.example/davit-operator", "tag": "0.1.0"},
                "modelDelivery": {
                    "cacheClaim": "model-cache",
                    "hfEndpoint": "http://hub-mirror.models.svc:8090",
                    "s3Endpoint": "https://s3.example:9000",
                    "maxBytesPerSecond": 200_000_000,
                },
            },
            values_dir=tmp_path,
        )
    )
    parsed = _operator_parser().parse_args(container["args"])
    assert parsed.model_cache == "model-cache"
    assert parsed.hf_endpoint == "http://hub-mirror.models.svc:8090"
    assert parsed.s3_endpoint == "https://s3.example:9000"
    assert parsed.fetch_max_bytes_per_second == 200_000_000
    assert parsed.fetch_image == "registry.example/davit-operator:0.1.0" == container["image"]
    own = operator_container(
        helm.template("modelDelivery.cacheClaim=emptyDir", "modelDelivery.fetchImage=fetch:1")
    )
    parsed = _operator_parser().parse_args(own["args"])
    assert parsed.model_cache == "emptyDir" and parsed.fetch_image == "fetch:1"


def test_include_crds_renders_the_inference_service_crd(helm: Helm) -> None:
    crds = find(helm.template(include_crds=True), "CustomResourceDefinition")
    assert sorted(c["metadata"]["name"] for c in crds) == [
        "clusterkopfpeerings.kopf.dev",
        "inferenceservices.serving.davit.dev",
        "kopfpeerings.kopf.dev",
    ]


def test_values_schema_is_valid_json_with_strict_top_level() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # Every default value is declared in the schema, and vice versa (minus helm's "global").
    assert set(values) == set(schema["properties"]) - {"global"}


def test_packaged_chart_carries_crds_and_schema_and_renders(helm: Helm, tmp_path: Path) -> None:
    result = helm.run("package", str(CHART), f"--destination={tmp_path}")
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("davit-*.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    expected = {f"davit/crds/{p.name}" for p in (CHART / "crds").glob("*.yaml")} | {
        "davit/Chart.yaml",
        "davit/values.yaml",
        "davit/values.schema.json",
        "davit/templates/NOTES.txt",
    }
    assert expected <= names
    # The packaged archive is what users install: it must still render and validate values.
    rendered = helm.run("template", "davit", str(archive), f"--kube-version={KUBE_VERSION}")
    assert rendered.returncode == 0, rendered.stderr
    rejected = helm.run("template", "davit", str(archive), "--set=replicaCount=-1")
    assert rejected.returncode != 0 and "/replicaCount" in rejected.stderr
