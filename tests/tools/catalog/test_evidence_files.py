"""The committed release evidence (tools/davit_tools/catalog/evidence/*.json) is well formed and
consistent with itself. Reads only the committed files: no wheel, no network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from davit_tools.catalog.evidence import EVIDENCE_DIR
from davit_tools.catalog.features import catalog_feature
from davit_tools.catalog.schema import Evidence
from davit_tools.catalog.summary import list_role

RELEASES = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
PARSER_CHECKED = RELEASES


def _path(version: str) -> Path:
    return EVIDENCE_DIR / f"vllm-{version}.json"


def _raw(version: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(_path(version).read_text())
    return data


def _load(version: str) -> Evidence:
    return Evidence.model_validate(_raw(version))


def test_every_release_from_028_to_034_has_evidence() -> None:
    missing = [v for v in RELEASES if not _path(v).is_file()]
    assert not missing, f"no evidence for {missing}: run python -m davit_tools.catalog.evidence"


@pytest.mark.parametrize("version", RELEASES)
def test_file_is_written_as_the_tool_writes_it(version: str) -> None:
    """Valid against the schema, and byte for byte what the tool's writer produces (sorted
    keys, one-space indent), so a hand edit shows up here."""
    evidence = _load(version)
    data = evidence.model_dump(mode="json", by_alias=True)
    text = json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    assert _path(version).read_text() == text
    assert evidence.version == version


@pytest.mark.parametrize("version", RELEASES)
def test_artifact_identity_matches_the_release(version: str) -> None:
    evidence = _load(version)
    assert evidence.published, f"{version} is published on the index"
    artifact = evidence.artifact
    assert artifact is not None
    assert artifact.filename.startswith(f"vllm-{version}-")
    assert artifact.filename.endswith(".whl")
    assert artifact.metadata_version == version
    assert artifact.source == f"vllm-{version}.dist-info/METADATA"


@pytest.mark.parametrize("version", RELEASES)
def test_runner_facts_agree_with_each_other(version: str) -> None:
    evidence = _load(version)
    runners, switch, selection = evidence.runners, evidence.switch, evidence.selection
    assert runners is not None and switch is not None and selection is not None
    gpu = {(r.kind, r.source) for r in runners.shipped if r.device == "gpu"}
    assert runners.has_v1 == any(kind == "v1" for kind, _ in gpu)
    assert runners.has_v2 == any(kind == "v2" for kind, _ in gpu)
    assert runners.has_v2, "every release from 0.28 on ships MRV2"
    for runner in runners.shipped:
        assert runner.lineage[:1] in ([], [f"{runner.source}:{runner.class_name}"])
        assert (runner.kind == "standalone") == (not runner.lineage)
    # The switch is declared exactly when it is parsed from the environment, and a release that
    # still decides between two runners reads it in that decision.
    assert switch.declared == (switch.parse is not None)
    if switch.declared:
        assert switch.name in str(switch.parse)
    if selection.method is not None:
        assert runners.has_v1, "a runner decision needs two runners"
        assert switch.declared
        assert any(selection.method in reader for reader in switch.readers)
    if not runners.has_v1:
        assert selection.method is None
        assert all(v.condition == "always" for v in selection.validations)
    reads = evidence.runner_reads
    assert reads is not None
    for feature, by_runner in reads.reads.items():
        for kind, places in by_runner.items():
            if kind == "v1" and not runners.has_v1:
                assert not places, f"{feature}: MRV1 code read in a release without MRV1"


@pytest.mark.parametrize("version", RELEASES)
def test_feature_lists_and_summary_agree(version: str) -> None:
    evidence = _load(version)
    assert evidence.summary is not None and evidence.runners is not None
    effects = evidence.summary.effects
    listed = {item.text for f in evidence.feature_lists for item in f.items}
    for feature_list in evidence.feature_lists:
        assert feature_list.role == list_role(feature_list.method)
        for item in feature_list.items:
            assert item.catalog_feature == catalog_feature(item.text)
            assert item.condition
    for effect, texts in effects.items():
        assert texts, f"{effect} is listed without features"
        if effect != "forcesV2" and effect != "selectsV1OnAuto":
            assert set(texts) <= listed, f"{effect} names features no list reports"
    if not evidence.runners.has_v1:
        assert "selectsV1OnAuto" not in effects and "refusedOnV1" not in effects
    for guard in evidence.guards:
        assert "use_v2_model_runner" in guard.condition


@pytest.mark.parametrize("version", RELEASES)
def test_build_facts_agree(version: str) -> None:
    build = _load(version).build
    assert build is not None
    cuda = build.cuda
    majors = {lib.cudart_major for lib in cuda.libraries if lib.cudart_major is not None}
    releases = {r for lib in cuda.libraries for r in lib.nvcc_releases}
    assert majors == {cuda.cudart_major}
    assert releases == {cuda.version}
    assert cuda.version is not None and cuda.version.split(".")[0] == str(cuda.cudart_major)
    assert all(f"cu{cuda.cudart_major}" in r for r in cuda.cuda_tagged_requirements)
    assert build.pins.torch is not None and build.pins.torch.startswith("==")
    torch_wheel = build.torch_wheel
    assert torch_wheel is not None
    assert torch_wheel.filename.startswith(f"torch-{build.pins.torch[2:]}-")
    # The pinned torch requires the CUDA toolkit of the same major the native code loads.
    assert torch_wheel.cuda_toolkit is not None
    assert torch_wheel.cuda_toolkit.lstrip("=~<>!").startswith(f"{cuda.cudart_major}.")


@pytest.mark.parametrize("version", RELEASES)
def test_contract_results_agree_with_the_static_reading(version: str) -> None:
    evidence = _load(version)
    contract, flags = evidence.contract, evidence.flags
    assert contract is not None and flags is not None
    if version in PARSER_CHECKED:
        assert contract.checked and contract.verified
    names = [line.name for line in contract.command_lines]
    assert len(names) == len(set(names))
    assert any(n.startswith("example:") for n in names)
    assert any(n.startswith("feature:") for n in names)
    used = {a for line in contract.command_lines for a in line.args if a.startswith("--")}
    assert used == set(flags.flags), "flags lists exactly the flags the command lines use"
    for line in contract.command_lines:
        unknown = [a for a in line.args if a.startswith("--") and not flags.flags[a].exists]
        assert line.static_check.unknown_flags == unknown
        if not contract.checked or not line.args:
            # Not run, or an empty line (the operator's builder refuses the spec there).
            assert line.parsed is None and line.error is None
            continue
        assert line.parsed is not None
        assert (line.error is None) == line.parsed, line.name
        if line.static_check.unknown_flags:
            assert not line.parsed, f"{line.name}: the parser accepted a flag the source lacks"
        if line.static_check.unknown_json_keys:
            # Config classes forbid unknown fields: a key the source lacks must not parse.
            assert not line.parsed, f"{line.name}: the parser accepted a key the source lacks"
        if line.parsed:
            assert line.engine_args is not None
            assert set(line.values) - {"model_tag"} <= set(line.args)


@pytest.mark.parametrize("version", RELEASES)
def test_pass_config_and_probes_agree(version: str) -> None:
    """The sequence-parallelism key the tool names is a bool field of PassConfig, and the
    release's parser accepts exactly that candidate key."""
    evidence = _load(version)
    pass_config, contract = evidence.pass_config, evidence.contract
    assert pass_config is not None and contract is not None
    fields = {f.name: f for f in pass_config.fields}
    key = pass_config.sequence_parallelism_key
    if key is not None:
        assert "bool" in fields[key].annotation
        assert fields[key].doc.lower().startswith("enable sequence parallelism")
    probes = {line.name: line for line in contract.command_lines if line.name.startswith("probe:")}
    assert probes, "the probes of the candidate keys are recorded"
    for name, line in probes.items():
        probed = name.removeprefix("probe:pass_config.")
        if contract.checked:
            assert line.parsed == (probed == key), name
        assert bool(line.static_check.unknown_json_keys) == (probed not in fields), name
