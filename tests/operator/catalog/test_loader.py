"""The packaged catalog: the upstream release facts it records, and refusal of malformed data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from davit_operator.catalog.loader import CatalogError, load_catalog, version_key

PACKAGED = Path(load_catalog.__code__.co_filename).parent


def _copy(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    for name in ("engines.yaml", "accelerators.yaml"):
        (tmp_path / name).write_text((PACKAGED / name).read_text())
    return tmp_path, yaml.safe_load((tmp_path / "engines.yaml").read_text())


def test_vllm_releases_runners_and_variants() -> None:
    vllm = load_catalog().engines.engines["vllm"]
    assert vllm.versions == [
        "0.28.0",
        "0.29.0",
        "0.30.0",
        "0.31.0",
        "0.32.0",
        "0.33.0",
        "0.34.0",
    ]
    for version in ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"):
        release = vllm.release(version)
        assert release is not None
        # Every release up to 0.33.0 ships both runners and reads the variable (the wheels say
        # so; the v0.29 notes' plan to remove V1 in 0.32 did not happen).
        assert sorted(release.runners) == ["v1", "v2"] and release.default_runner == "v2"
        assert release.runner_switch is not None
        assert release.runner_switch.name == "VLLM_USE_V2_MODEL_RUNNER"
        assert release.runner_switch.values == {"v2": "1", "v1": "0"}
    latest = vllm.release("0.34.0")
    assert latest is not None and latest.runners == ["v2"] and latest.runner_switch is None
    assert vllm.last_with("v1", before="0.34.0").version == "0.33.0"  # type: ignore[union-attr]
    release_033 = vllm.release("0.33.0")
    assert release_033 is not None
    assert (release_033.title, release_033.tag) == ("v0.33.0", "v0.33.0rc3")
    assert release_033.images["cuda13.0"].tag == "v0.33.0rc3"
    assert release_033.images["cuda13.0"].repository == "vllm/vllm-openai"
    assert release_033.images["rocm"].repository == "vllm/vllm-openai-rocm"
    assert not release_033.images["cuda12.9"].published
    assert vllm.last_publishing("cuda12.9", before="0.34.0").version == "0.32.0"  # type: ignore[union-attr]


def test_facts_that_no_artifact_here_verifies_name_their_source() -> None:
    catalog = load_catalog().engines
    for engine in catalog.engines.values():
        for release in engine.releases:
            for source in [release.tag_source] + [e.source for e in release.images.values()]:
                assert "Not verified against an artifact." in catalog.sources[source], source


def test_releases_newer_than_the_catalog_use_the_newest_facts() -> None:
    vllm = load_catalog().engines.engines["vllm"]
    assert vllm.facts_for("0.35.0") is vllm.release("0.34.0")
    assert vllm.facts_for("1.0.0") is vllm.release("0.34.0")
    assert vllm.facts_for("0.33.1") is None  # inside the catalog's range: unknown
    assert vllm.facts_for("0.27.0") is None


def test_davit_images_share_one_repository() -> None:
    davit = load_catalog().engines.engines["davit"]
    for release in davit.releases:
        repositories = {e.repository for e in release.images.values() if e.is_recorded}
        assert repositories == {"ghcr.io/davit-dev/davit-engine"}
        for variant, entry in release.images.items():
            if entry.is_recorded:
                assert entry.tag == f"{release.version}-{variant}"


def test_unknown_digests_are_explicit() -> None:
    for engine in load_catalog().engines.engines.values():
        for release in engine.releases:
            for entry in release.images.values():
                assert entry.digest is None or entry.digest.startswith("sha256:")


def test_default_runner_must_exist(tmp_path: Path) -> None:
    directory, data = _copy(tmp_path)
    data["engines"]["vllm"]["releases"][-1]["defaultRunner"] = "v1"  # type: ignore[index]
    (directory / "engines.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(CatalogError) as err:
        load_catalog(directory)
    assert "engines.yaml" in str(err.value) and "defaultRunner v1 is not in runners" in str(
        err.value
    )


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (lambda r: r.update(runnerSwitch=None), "needs a runnerSwitch"),
        (
            lambda r: r["runnerSwitch"].update(values={"v2": "1"}),
            "runnerSwitch.values must name every runner",
        ),
        (
            lambda r: r["runnerRules"].append({"text": "x", "effects": ["refused"]}),
            "refused is for single-runner releases",
        ),
        (
            lambda r: r["runnerRules"].append(
                {"text": "y", "effects": ["refusedOnV2"], "when": ["speculativeMethod"]}
            ),
            "methods go with (and only with) speculativeMethod",
        ),
        (
            lambda r: r["runnerRules"].append(
                {"text": "z", "effects": ["refusedOnV2"], "when": []}
            ),
            "an unconditional rule must name its variants",
        ),
        (
            lambda r: r["runnerRules"].append(
                {"text": "w", "effects": ["refusedOnV2"], "when": ["warpSpeed"]}
            ),
            "warpSpeed",
        ),
        (
            lambda r: r["arguments"].update(sequenceParallelism=None),
            "capabilities.unsupportedFeatures must list sequenceParallelism",
        ),
        (lambda r: r.update(tagSource="hearsay"), "unknown sources ['hearsay']"),
    ],
)
def test_malformed_runner_facts_stop_the_catalog(tmp_path: Path, edit: Any, complaint: str) -> None:
    directory, data = _copy(tmp_path)
    edit(data["engines"]["vllm"]["releases"][3])  # type: ignore[index]
    (directory / "engines.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(CatalogError) as err:
        load_catalog(directory)
    assert "engines.yaml" in str(err.value) and complaint in str(err.value)


def test_single_runner_rules_use_refused(tmp_path: Path) -> None:
    directory, data = _copy(tmp_path)
    latest = data["engines"]["vllm"]["releases"][-1]  # type: ignore[index]
    latest["runnerRules"].append({"text": "x", "effects": ["refusedOnV2"], "when": ["lora"]})
    (directory / "engines.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(CatalogError, match="need two runners; use refused"):
        load_catalog(directory)


def test_releases_must_be_ordered(tmp_path: Path) -> None:
    directory, data = _copy(tmp_path)
    releases = data["engines"]["vllm"]["releases"]  # type: ignore[index]
    releases[0], releases[1] = releases[1], releases[0]
    (directory / "engines.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(CatalogError, match="ascending order"):
        load_catalog(directory)


def test_unpublished_variant_cannot_name_an_image(tmp_path: Path) -> None:
    directory, data = _copy(tmp_path)
    images = data["engines"]["vllm"]["releases"][-1]["images"]  # type: ignore[index]
    images["cuda12.9"] = {
        "published": False,
        "repository": "vllm/vllm-openai",
        "tag": "x",
        "source": "vllm-release-pages",
    }
    (directory / "engines.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(CatalogError, match="unpublished variant"):
        load_catalog(directory)


def test_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    directory, _ = _copy(tmp_path)
    (directory / "accelerators.yaml").write_text("vendors: [unclosed")
    with pytest.raises(CatalogError, match="accelerators.yaml: not valid YAML"):
        load_catalog(directory)


def test_version_key_orders_numerically() -> None:
    assert sorted(["0.10.0", "0.9.1", "0.33.0"], key=version_key) == ["0.9.1", "0.10.0", "0.33.0"]
