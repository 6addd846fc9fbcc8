"""Canary weights on a Gateway API HTTPRoute: the rules rewrite (pure) and, on the local
control plane with the real HTTPRoute CRD (sigs.k8s.io/gateway-api from the Go module cache),
the operator's Services and weights."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from davit_operator.rollout.gateway import routes_to, weighted_rules
from tests.operator.isvc_cluster import apply_yaml, wait_for
from tests.operator.isvc_helpers import merge
from tests.support import unavailable

GATEWAY_API = "sigs.k8s.io/gateway-api@v1.3.0"


def ref(name: str, weight: int | None = None, port: int = 8000) -> dict[str, Any]:
    out: dict[str, Any] = {"group": "", "kind": "Service", "name": name, "port": port}
    if weight is not None:
        out["weight"] = weight
    return out


def test_rules_pointing_at_the_service_get_stable_and_canary_weights() -> None:
    rules = [
        {
            "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
            "backendRefs": [ref("llm")],
        },
        {
            "matches": [{"path": {"type": "PathPrefix", "value": "/other"}}],
            "backendRefs": [ref("x")],
        },
        {"backendRefs": [ref("llm", 9), {"name": "legacy", "port": 80, "weight": 1}]},
    ]
    out = weighted_rules(rules, "llm", 8000, 25)
    assert out[0]["matches"] == rules[0]["matches"]
    assert out[0]["backendRefs"] == [ref("llm-stable", 75), ref("llm-canary", 25)]
    assert out[1] == rules[1]
    assert out[2]["backendRefs"] == [
        {"name": "legacy", "port": 80, "weight": 1},
        ref("llm-stable", 75),
        ref("llm-canary", 25),
    ]
    # Idempotent, and back to all-stable at weight 0.
    assert weighted_rules(out, "llm", 8000, 25) == out
    back = weighted_rules(out, "llm", 8000, 0)
    assert back[0]["backendRefs"] == [ref("llm-stable", 100), ref("llm-canary", 0)]
    assert routes_to(rules, "llm") and not routes_to(rules, "other")
    # A backend of another kind with the same name is not ours.
    foreign = [{"backendRefs": [{"group": "x.io", "kind": "Backend", "name": "llm"}]}]
    assert weighted_rules(foreign, "llm", 8000, 50) == foreign


def _httproute_crd() -> Path:
    """The HTTPRoute CRD of the Gateway API release, from the Go module cache (downloaded
    through the module proxy when missing)."""
    try:
        out = subprocess.run(
            ["go", "mod", "download", "-json", GATEWAY_API],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/tmp",
            env={**os.environ, "GOFLAGS": "-mod=mod"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        unavailable(f"no Go toolchain to fetch {GATEWAY_API}: {exc}")
    if out.returncode != 0:
        unavailable(f"{GATEWAY_API} not available: {out.stderr.strip()[:300]}")
    directory = Path(json.loads(out.stdout)["Dir"])
    return directory / "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml"


CANARY = {
    "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"},
    "engine": {"type": "davit", "version": "0.1.0"},
    "accelerator": {"vendor": "cpu"},
    "replicas": 2,
    "limits": {"kvCacheMemoryBytes": 64 << 20},
    "rollout": {
        "strategy": "Canary",
        "canary": {"steps": [{"weight": 25, "pauseSeconds": 600}], "httpRoute": "web"},
        "progressDeadlineSeconds": 600,
    },
}


def _isvc(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm"},
        "spec": spec,
    }


@pytest.mark.cluster
def test_canary_weights_land_on_the_httproute(
    kube_cluster: Any, kube_namespace: str, start_operator: Any
) -> None:
    crd = _httproute_crd()
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    kube_cluster.wait_established("crd/httproutes.gateway.networking.k8s.io")
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "web"},
        "spec": {
            "parentRefs": [{"name": "public"}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                    "backendRefs": [{"name": "llm", "port": 8000}],
                }
            ],
        },
    }
    kube_cluster.kubectl("apply", "-n", kube_namespace, "-f", "-", input=yaml.safe_dump(route))
    start_operator(drift_interval=1.0)
    apply_yaml(kube_cluster, kube_namespace, [_isvc(CANARY)])

    def get(kind: str, name: str) -> dict[str, Any]:
        out = kube_cluster.kubectl("get", kind, name, "-n", kube_namespace, "-o", "json")
        result: dict[str, Any] = json.loads(out.stdout)
        return result

    wait_for(
        "first revision stable",
        lambda: (
            (get("infsvc", "llm").get("status", {}).get("rollout") or {}).get("phase") == "Complete"
            or None
        ),
        timeout=60,
    )
    # Steady: the route sends everything to the stable Service.
    stable_only = wait_for(
        "route on the stable Service",
        lambda: (
            get("httproute", "web")["spec"]["rules"][0]["backendRefs"]
            if get("httproute", "web")["spec"]["rules"][0]["backendRefs"][0]["name"] == "llm-stable"
            else None
        ),
        timeout=30,
    )
    assert [(r["name"], r["weight"]) for r in stable_only] == [
        ("llm-stable", 100),
        ("llm-canary", 0),
    ]
    services = {
        name: get("service", name)["spec"]["selector"] for name in ("llm-stable", "llm-canary")
    }
    assert services["llm-canary"]["serving.davit.dev/track"] == "canary"
    assert services["llm-stable"]["serving.davit.dev/track"] == "stable"

    apply_yaml(kube_cluster, kube_namespace, [_isvc(merge(CANARY, {"limits": {"maxNumSeqs": 8}}))])
    weights = wait_for(
        "canary weight on the route",
        lambda: (
            [
                (r["name"], r["weight"])
                for r in get("httproute", "web")["spec"]["rules"][0]["backendRefs"]
            ]
            if get("httproute", "web")["spec"]["rules"][0]["backendRefs"][1]["weight"] == 25
            else None
        ),
        timeout=60,
    )
    assert weights == [("llm-stable", 75), ("llm-canary", 25)]
    obj = get("infsvc", "llm")
    assert obj["status"]["rollout"]["routing"] == "HTTPRoute/web"
    # With the route splitting traffic, the stable side keeps both replicas beside the canary.
    time.sleep(2)
    assert get("deployment", "llm")["spec"]["replicas"] == 2
    assert get("deployment", "llm-canary")["spec"]["replicas"] == 1
    # The user's parts of the route are untouched.
    live = get("httproute", "web")["spec"]
    assert live["parentRefs"][0]["name"] == "public"
    assert live["rules"][0]["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
