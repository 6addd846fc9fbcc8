"""The packaged catalog: the upstream release facts it records, and refusal of malformed data."""

from __future__ import annotations

from pathlib import Path

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
    assert vllm.versions == ["0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]
    assert vllm.release("0.28.0").default_runner == "v1"  # type: ignore[union-attr]
    for version in ("0.29.0", "0.30.0", "0.31.0"):
        release = vllm.release(version)
        assert release is not None
        assert release.default_runner == "v2" and "v1" in release.deprecated_runners
    assert vllm.first_without("v1").version == "0.32.0"  # type: ignore[union-attr]
    latest = vllm.release("0.33.0")
    assert latest is not None
    assert (latest.title, latest.tag) == ("v0.33.0", "v0.33.0rc3")
    assert latest.images["cuda13.0"].tag == "v0.33.0rc3"
    assert latest.images["cuda13.0"].repository == "vllm/vllm-openai"
    assert latest.images["rocm"].repository == "vllm/vllm-openai-rocm"
    assert not latest.images["cuda12.9"].published
    assert vllm.last_publishing("cuda12.9", before="0.33.0").version == "0.32.0"  # type: ignore[union-attr]


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
    images["cuda12.9"] = {"published": False, "repository": "vllm/vllm-openai", "tag": "x"}
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
