"""hack/controlplane/build.sh: pinned wrapper modules, static binaries, a fast warm path."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest

from davit_tools.devcluster import LocalCluster, pinned_versions
from davit_tools.devcluster.paths import BINARIES

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[3]
CONTROLPLANE = REPO / "hack" / "controlplane"
PT_INTERP = 3


def _has_interpreter(binary: Path) -> bool:
    """True for a dynamically linked ELF executable (one with a PT_INTERP program header)."""
    with open(binary, "rb") as f:
        header = f.read(64)
        assert header[:4] == b"\x7fELF" and header[4] == 2, f"{binary} is not a 64-bit ELF"
        (phoff,) = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return any(struct.unpack_from("<I", table, i * phentsize)[0] == PT_INTERP for i in range(phnum))


def test_binaries_are_static(kube_cluster: LocalCluster) -> None:
    # CGO_ENABLED=0: the binaries run on any Linux without a matching C library.
    for name in BINARIES:
        assert not _has_interpreter(kube_cluster.bin_dir / name), f"{name} is dynamically linked"


def test_warm_build_is_a_no_op(kube_cluster: LocalCluster) -> None:
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(CONTROLPLANE / "build.sh")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stderr
    assert time.monotonic() - started < 10


def test_k8s_wrapper_replaces_every_staging_module_of_the_release() -> None:
    kubernetes = pinned_versions().kubernetes
    download = subprocess.run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{kubernetes}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=CONTROLPLANE / "k8s",
        check=True,
    )
    release_mod = Path(json.loads(download.stdout)["GoMod"]).read_text()
    staging = set(re.findall(r"^\s*(k8s\.io/[\w-]+) => \./staging/", release_mod, re.M))
    wrapper = (CONTROLPLANE / "k8s" / "go.mod").read_text()
    published = "v0." + kubernetes.removeprefix("v1.")
    replaced = dict(re.findall(r"^\s*(k8s\.io/[\w-]+) => k8s\.io/[\w-]+ (v\S+)", wrapper, re.M))
    assert len(staging) >= 30
    assert set(replaced) == staging
    assert set(replaced.values()) == {published}
    assert f"k8s.io/kubernetes {kubernetes}" in wrapper


@pytest.mark.parametrize("module", ["etcd", "kwok"])
def test_other_wrappers_pin_the_versions_file(module: str) -> None:
    versions = pinned_versions()
    path = {"etcd": "go.etcd.io/etcd/server/v3", "kwok": "sigs.k8s.io/kwok"}[module]
    wrapper = (CONTROLPLANE / module / "go.mod").read_text()
    assert f"{path} {getattr(versions, module)}" in wrapper
    assert (CONTROLPLANE / module / "go.sum").stat().st_size > 0


def test_committed_wrapper_modules_are_what_update_modules_generates(tmp_path: Path) -> None:
    # Same relative layout as the repository, so the script finds versions.json.
    script_dir = tmp_path / "hack" / "controlplane"
    script_dir.mkdir(parents=True)
    shutil.copy(CONTROLPLANE / "update-modules.sh", script_dir)
    versions_dir = tmp_path / "tools" / "davit_tools" / "devcluster"
    versions_dir.mkdir(parents=True)
    shutil.copy(REPO / "tools" / "davit_tools" / "devcluster" / "versions.json", versions_dir)
    result = subprocess.run(
        ["bash", str(script_dir / "update-modules.sh")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for module in ("k8s", "etcd", "kwok"):
        for name in ("go.mod", "go.sum"):
            generated = (script_dir / module / name).read_text()
            committed = (CONTROLPLANE / module / name).read_text()
            assert generated == committed, (
                f"hack/controlplane/{module}/{name} is stale: run "
                "`bash hack/controlplane/update-modules.sh` and commit the result"
            )
