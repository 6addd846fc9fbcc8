"""Where the local control plane's binaries, stage configs and state live.

Binaries are built by ``hack/controlplane/build.sh`` into a cache outside the repository, keyed by
the pinned Kubernetes version, so every checkout and every test session reuses one build.
Environment variables are read here and nowhere else in this package.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
)
STAGE_FILES = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)


@dataclass(frozen=True)
class Versions:
    """Pinned component versions (``versions.json``, shared with ``build.sh``)."""

    kubernetes: str
    etcd: str
    kwok: str

    @property
    def kubernetes_minor(self) -> str:
        """``"1.35"`` for ``"v1.35.8"``."""
        return ".".join(self.kubernetes.lstrip("v").split(".")[:2])


def pinned_versions() -> Versions:
    raw = json.loads(resources.files(__package__).joinpath("versions.json").read_text())
    return Versions(kubernetes=raw["kubernetes"], etcd=raw["etcd"], kwok=raw["kwok"])


def cache_root() -> Path:
    """``$DAVIT_CACHE``, else ``~/.cache/davit``."""
    env = os.environ.get("DAVIT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "davit"


def toolchain_dir(versions: Versions | None = None) -> Path:
    """The build's output folder for one Kubernetes version (holds ``bin/`` and ``kwok-stages/``)."""
    return cache_root() / "k8s" / (versions or pinned_versions()).kubernetes


def default_bin_dir() -> Path:
    """``$DAVIT_K8S_BIN_DIR`` if set (binaries built elsewhere), else the cache's ``bin/``."""
    env = os.environ.get("DAVIT_K8S_BIN_DIR")
    return Path(env) if env else toolchain_dir() / "bin"


def default_stage_dir(bin_dir: Path) -> Path:
    """kwok stage configs sit beside ``bin/``; ``$DAVIT_KWOK_STAGE_DIR`` overrides."""
    env = os.environ.get("DAVIT_KWOK_STAGE_DIR")
    return Path(env) if env else bin_dir.parent / "kwok-stages"


def cli_state_dir() -> Path:
    """State of the detached cluster run by ``python -m davit_tools.devcluster up``."""
    return cache_root() / "cluster"


def reuse_kubeconfig() -> Path | None:
    """``$DAVIT_KUBECONFIG``: a running cluster that test sessions reuse instead of starting one."""
    env = os.environ.get("DAVIT_KUBECONFIG")
    return Path(env) if env else None


def missing_tools(bin_dir: Path, stage_dir: Path) -> list[Path]:
    """Binaries and stage files that must exist before a cluster can start."""
    wanted = [bin_dir / name for name in BINARIES] + [stage_dir / name for name in STAGE_FILES]
    return [path for path in wanted if not path.exists()]
