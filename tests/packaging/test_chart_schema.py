"""values.schema.json: bad values fail `helm template` with a message naming the field."""

from __future__ import annotations

import pytest

from .tools import Helm, only

# (--set arguments, the field the error must name, a fragment of the reason)
BAD_VALUES = [
    (["replicaCount=-1"], "/replicaCount", "minimum"),
    (["replicaCount=0"], "/replicaCount", "minimum"),
    (["replicaCount=two"], "/replicaCount", "integer"),
    (["replicaCount=6"], "/replicaCount", "maximum"),
    (["unknownKey=1"], "unknownKey", "not allowed"),
    (["image.registry=x"], "registry", "not allowed"),
    (["image.pullPolicy=Sometimes"], "/image/pullPolicy", "IfNotPresent"),
    (["image.digest=sha256:abc"], "/image/digest", "pattern"),
    (["image.tag=latest tag"], "/image/tag", "pattern"),
    (["watchNamespace=Team_A"], "/watchNamespace", "pattern"),
    (["metrics.port=80"], "/metrics/port", "minimum"),
    (["metrics.port=70000"], "/metrics/port", "maximum"),
    (["health.port=0"], "/health/port", "minimum"),
    (["metrics.service.type=ExternalName"], "/metrics/service/type", "ClusterIP"),
    (["metrics.serviceMonitor.interval=often"], "/metrics/serviceMonitor/interval", "pattern"),
    (["verbose=yes"], "/verbose", "boolean"),
    (["driftIntervalSeconds=0"], "/driftIntervalSeconds", "minimum"),
    (["extraArgs[0]=positional"], "/extraArgs/0", "pattern"),
    (["podSecurityContext.runAsNonRoot=false"], "/podSecurityContext/runAsNonRoot", "true"),
    (["podSecurityContext.runAsUser=0"], "/podSecurityContext/runAsUser", "minimum"),
    (
        ["securityContext.allowPrivilegeEscalation=true"],
        "/securityContext/allowPrivilegeEscalation",
        "false",
    ),
    (["securityContext.privileged=true"], "/securityContext/privileged", "false"),
    (["resources.requests.memory=lots"], "/resources/requests/memory", ""),
    (["terminationGracePeriodSeconds=-5"], "/terminationGracePeriodSeconds", "minimum"),
    (["modelDelivery.cacheClaim=Model_Cache"], "/modelDelivery/cacheClaim", "pattern"),
    (["modelDelivery.hfEndpoint=hub.local"], "/modelDelivery/hfEndpoint", "pattern"),
    (["modelDelivery.s3Endpoint=s3://bucket"], "/modelDelivery/s3Endpoint", "pattern"),
    (["modelDelivery.maxBytesPerSecond=-1"], "/modelDelivery/maxBytesPerSecond", "minimum"),
    (["modelDelivery.claimName=x"], "claimName", "not allowed"),
]


@pytest.mark.parametrize(("set_args", "field", "reason"), BAD_VALUES, ids=lambda v: str(v))
def test_schema_rejects_bad_values(
    helm: Helm, set_args: list[str], field: str, reason: str
) -> None:
    result = helm.run(*helm.template_args(*set_args))
    assert result.returncode != 0, f"accepted {set_args}"
    assert field in result.stderr, result.stderr
    assert reason in result.stderr, result.stderr
    assert result.stdout == ""


def test_replica_count_error_names_the_field_and_bound(helm: Helm) -> None:
    result = helm.run(*helm.template_args("replicaCount=-1"))
    assert result.returncode != 0
    assert "at '/replicaCount': minimum: got -1, want 1" in result.stderr


def test_service_account_name_required_when_not_created(helm: Helm) -> None:
    result = helm.run(*helm.template_args("serviceAccount.create=false"))
    assert result.returncode != 0
    assert "serviceAccount.name is required" in result.stderr
    objects = helm.template("serviceAccount.create=false", "serviceAccount.name=platform-sa")
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "platform-sa"
    assert not [o for o in objects if o["kind"] == "ServiceAccount"]


@pytest.mark.parametrize(
    "set_args",
    [
        ["replicaCount=1", "leaderElection.enabled=false"],
        ["watchNamespace=team-a"],
        ["image.digest=sha256:" + "0" * 64],
        ["resources.requests.cpu=0.5", "resources.limits.memory=1Gi"],
        ["metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.interval=1m30s"],
        ["modelDelivery.cacheClaim=emptyDir", "modelDelivery.hfEndpoint=https://hub.example"],
    ],
    ids=lambda v: str(v),
)
def test_schema_accepts_good_values(helm: Helm, set_args: list[str]) -> None:
    result = helm.run(*helm.template_args(*set_args))
    assert result.returncode == 0, result.stderr
    assert "kind: Deployment" in result.stdout
