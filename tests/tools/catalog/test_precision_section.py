"""The evidence tool's `precision` section and `--update`, on a wheel made here (the committed
files' own sections are checked against the catalog in tests/operator/catalog)."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest

from davit_tools.catalog import evidence, sections
from davit_tools.catalog.wheel import ReleaseWheel

EVIDENCE = Path(evidence.__file__).with_name("evidence")


def _wheel(tmp_path: Path, quantization: str, cache: str) -> ReleaseWheel:
    path = tmp_path / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("vllm-0.34.0.dist-info/METADATA", "Name: vllm\nVersion: 0.34.0\n")
        wheel.writestr(
            sections.QUANTIZATION,
            f"from typing import Literal\nQuantizationMethods = Literal[{quantization}]\n",
        )
        wheel.writestr(
            sections.CACHE,
            "from typing import Literal\n"
            f"Fp8Kinds = Literal[{cache}]\nCacheDType = Literal['auto', Fp8Kinds]\n",
        )
    return ReleaseWheel(path)


def test_precision_reads_both_literals(tmp_path: Path) -> None:
    found = sections.precision(_wheel(tmp_path, "'fp8', 'awq'", "'fp8_e5m2'"))
    assert found == {
        "quantization": {
            "known": ["awq", "fp8"],
            "operator": {"fp8": True},
            "source": sections.QUANTIZATION,
        },
        # a Literal naming another one is followed; fp8_e5m2 is not the operator's fp8
        "kvCacheDtypes": {
            "known": ["auto", "fp8_e5m2"],
            "operator": {"fp8": False},
            "source": sections.CACHE,
        },
        "verified": True,
    }


def test_update_recomputes_one_section_and_keeps_the_rest(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "'awq'", "'fp8'")
    out = tmp_path / "evidence"
    out.mkdir()
    committed = json.loads((EVIDENCE / "vllm-0.34.0.json").read_text())
    committed["artifact"]["sha256"] = wheel.sha256  # as if written from this wheel
    (out / "vllm-0.34.0.json").write_text(json.dumps(committed))
    data = evidence.updated(wheel, out, ["precision"]).model_dump(mode="json", by_alias=True)
    assert data["precision"]["quantization"]["operator"] == {"fp8": False}
    assert data["precision"]["kvCacheDtypes"]["operator"] == {"fp8": True}
    for key in committed.keys() - {"precision"}:
        assert data[key] == committed[key], key


def test_update_refuses_a_file_of_another_wheel(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "'fp8'", "'fp8'")
    out = tmp_path / "evidence"
    out.mkdir()
    shutil.copy(EVIDENCE / "vllm-0.34.0.json", out)
    with pytest.raises(SystemExit, match="written from another wheel"):
        evidence.updated(wheel, out, ["precision"])
