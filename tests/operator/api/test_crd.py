"""The generated CRD: in sync with the API types, structural, explainable, with CEL rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from davit_operator.api.crdgen import build_crd, crdgen_main, default_crd_path, render_crd
from davit_operator.api.identity import CRD_NAME


def _schema() -> dict[str, Any]:
    crd = build_crd()
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _walk(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, sub in (node.get("properties") or {}).items():
        found += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        found += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _walk(node["additionalProperties"], f"{path}{{}}")
    return found


def test_committed_crd_matches_the_types() -> None:
    path = default_crd_path()
    assert path.name == "serving.davit.dev_inferenceservices.yaml"
    assert path.read_text() == render_crd(), "run `python -m davit_operator.api.crdgen`"
    assert crdgen_main(["--check"]) == 0


def test_check_fails_on_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text(render_crd().replace("infsvc", "isvc"))
    assert crdgen_main(["--check", "--output", str(stale)]) == 1
    err = capsys.readouterr().err
    assert "is stale" in err and "davit_operator.api.crdgen" in err
    assert crdgen_main(["--output", str(stale)]) == 0
    assert crdgen_main(["--check", "--output", str(stale)]) == 0


def test_identity_printer_columns_and_subresources() -> None:
    crd = yaml.safe_load(render_crd())
    assert crd["metadata"]["name"] == CRD_NAME
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "InferenceService",
        "inferenceservices",
        ["infsvc"],
    )
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    # kubectl scale and autoscalers work on the service; status says which pods it counts.
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Engine", "Runner", "Accelerator", "Ready", "Replicas", "Age"]


def test_schema_is_structural_and_explained() -> None:
    nodes = _walk(_schema(), "")
    for path, node in nodes:
        assert "$ref" not in node and "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            continue
        assert "type" in node, f"{path} has no type"
        if "anyOf" in node:
            pytest.fail(f"{path}: anyOf outside int-or-string")
    spec_paths = [(p, n) for p, n in nodes if p.startswith(".spec.")]
    undocumented = [p for p, n in spec_paths if "description" not in n and not p.endswith("[]")]
    undocumented = [p for p in undocumented if not p.endswith("{}")]
    assert undocumented == [], "kubectl explain needs a description on every spec field"


def test_enums_defaults_and_cel_rules_are_present() -> None:
    spec = _schema()["properties"]["spec"]
    engine = spec["properties"]["engine"]["properties"]
    assert engine["type"]["enum"] == ["davit", "vllm"]
    assert engine["runner"]["default"] == "auto"
    assert engine["variant"]["enum"] == ["cuda13.0", "cuda12.9", "rocm", "cpu", "xpu"]
    assert engine["quantization"]["enum"] == ["fp8"]
    assert engine["lmHeadQuantization"]["enum"] == ["fp8", "int8"]
    assert "default" not in engine["lmHeadQuantization"]  # unset: the model dtype's head
    assert spec["properties"]["parallelism"]["default"]["tensor"] == 1
    gmu = spec["properties"]["limits"]["properties"]["gpuMemoryUtilization"]
    assert gmu["minimum"] == 0 and gmu["exclusiveMinimum"] is True and gmu["maximum"] == 1
    rules = [
        rule["rule"]
        for _, node in _walk(_schema(), "")
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 15
    assert spec["required"] == ["model", "engine", "accelerator"]
