"""The chart's crds/ folder: a copy of the generated crds/ plus hack/packaging/crds/, never edited."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from .tools import CHART, REPO

SYNC = REPO / "hack" / "packaging" / "sync-chart-crds.sh"
GENERATED = REPO / "crds"
FRAMEWORK = REPO / "hack" / "packaging" / "crds"


def run_sync(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "hack/packaging/sync-chart-crds.sh"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_chart_crds_equal_their_sources() -> None:
    generated = sorted(GENERATED.glob("*.yaml"))
    assert generated, "crds/ is empty: run python -m davit_operator.api.crdgen"
    sources = {p.name: p for p in [*generated, *FRAMEWORK.glob("*.yaml")]}
    copies = {p.name: p for p in (CHART / "crds").iterdir()}
    assert sorted(copies) == sorted(sources), (
        "chart CRDs differ from their sources: run hack/packaging/sync-chart-crds.sh"
    )
    for name, source in sources.items():
        assert copies[name].read_bytes() == source.read_bytes(), (
            f"charts/davit/crds/{name} is stale: run hack/packaging/sync-chart-crds.sh"
        )
    result = run_sync(REPO, "--check")
    assert result.returncode == 0, result.stderr


def test_chart_crds_are_the_inference_service_and_peering_crds() -> None:
    crds = {}
    for path in (CHART / "crds").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition"
        crds[crd["metadata"]["name"]] = crd
    assert sorted(crds) == [
        "clusterkopfpeerings.kopf.dev",
        "inferenceservices.serving.davit.dev",
        "kopfpeerings.kopf.dev",
    ]
    assert "infsvc" in crds["inferenceservices.serving.davit.dev"]["spec"]["names"]["shortNames"]
    # kopf looks the peering resources up as kopf.dev/v1 clusterkopfpeerings (cluster-scoped) and
    # kopfpeerings (namespaced), and keeps free-form peer records in their status.
    for name, scope in [
        ("clusterkopfpeerings.kopf.dev", "Cluster"),
        ("kopfpeerings.kopf.dev", "Namespaced"),
    ]:
        spec = crds[name]["spec"]
        assert (spec["group"], spec["scope"], spec["names"]["plural"]) == (
            "kopf.dev",
            scope,
            name.split(".")[0],
        )
        (version,) = spec["versions"]
        assert version["name"] == "v1" and version["served"] and version["storage"]
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status["x-kubernetes-preserve-unknown-fields"] is True


def make_checkout(tmp_path: Path) -> Path:
    """A scratch copy of the parts of the repository the sync script touches."""
    root = tmp_path / "repo"
    (root / "hack/packaging").mkdir(parents=True)
    shutil.copy(SYNC, root / "hack/packaging/sync-chart-crds.sh")
    shutil.copytree(FRAMEWORK, root / "hack/packaging/crds")
    shutil.copytree(GENERATED, root / "crds")
    shutil.copytree(CHART / "crds", root / "charts/davit/crds")
    return root


def test_check_fails_on_a_changed_copy_and_sync_repairs_it(tmp_path: Path) -> None:
    root = make_checkout(tmp_path)
    copy = root / "charts/davit/crds/serving.davit.dev_inferenceservices.yaml"
    copy.write_text(copy.read_text() + "# hand edit\n")
    result = run_sync(root, "--check")
    assert result.returncode == 1
    assert f"{copy.name} differs" in result.stderr
    assert run_sync(root).returncode == 0
    assert copy.read_bytes() == (root / "crds" / copy.name).read_bytes()
    assert run_sync(root, "--check").returncode == 0


def test_check_fails_on_a_new_generated_crd(tmp_path: Path) -> None:
    root = make_checkout(tmp_path)
    new = root / "crds/serving.davit.dev_profiles.yaml"
    new.write_text("kind: CustomResourceDefinition\n")
    result = run_sync(root, "--check")
    assert result.returncode == 1
    assert "profiles.yaml differs" in result.stderr
    assert run_sync(root).returncode == 0
    assert (root / "charts/davit/crds" / new.name).read_bytes() == new.read_bytes()


def test_check_fails_on_a_stale_extra_file_and_sync_removes_it(tmp_path: Path) -> None:
    root = make_checkout(tmp_path)
    stale = root / "charts/davit/crds/old.davit.dev_things.yaml"
    stale.write_text("kind: CustomResourceDefinition\n")
    result = run_sync(root, "--check")
    assert result.returncode == 1
    assert "has no source" in result.stderr
    assert run_sync(root).returncode == 0
    assert not stale.exists()


def test_sync_refuses_a_name_in_both_sources(tmp_path: Path) -> None:
    root = make_checkout(tmp_path)
    shutil.copy(root / "hack/packaging/crds/kopf.dev_clusterkopfpeerings.yaml", root / "crds")
    result = run_sync(root)
    assert result.returncode == 1
    assert "keep one" in result.stderr


def test_sync_refuses_an_empty_source(tmp_path: Path) -> None:
    root = make_checkout(tmp_path)
    for f in (root / "crds").iterdir():
        f.unlink()
    result = run_sync(root)
    assert result.returncode == 1
    assert "crdgen" in result.stderr
    # Nothing in the chart was removed on the way.
    assert len(list((root / "charts/davit/crds").iterdir())) == 3
