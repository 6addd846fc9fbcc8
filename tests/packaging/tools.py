"""The packaging tools (helm, kubectl, hadolint, shellcheck) that hack/packaging/tools.sh installs, and a thin
helm wrapper that renders the chart into parsed objects."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "davit"
TOOLS_SCRIPT = REPO / "hack" / "packaging" / "tools.sh"
# The Kubernetes version the chart is linted and rendered for (the local control plane's minor).
KUBE_VERSION = "1.35.0"


@dataclass(frozen=True)
class Tools:
    helm: Path
    kubectl: Path
    hadolint: Path
    shellcheck: Path


def install_tools() -> Tools:
    """Runs tools.sh (a no-op when the cache is warm) and returns the binaries it installed."""
    result = subprocess.run(
        ["bash", str(TOOLS_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHON": os.environ.get("PYTHON", "python3")},
    )
    if result.returncode != 0:
        raise RuntimeError(f"hack/packaging/tools.sh failed:\n{result.stderr}")
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    tools = Tools(*(bin_dir / name for name in ("helm", "kubectl", "hadolint", "shellcheck")))
    for path in (tools.helm, tools.kubectl, tools.hadolint, tools.shellcheck):
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"tools.sh reported {bin_dir} but {path.name} is not executable")
    return tools


@dataclass(frozen=True)
class Helm:
    binary: Path
    # helm's cache, config and data folders, kept out of $HOME.
    state_dir: Path

    def run(
        self, *args: str, kubeconfig: Path | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Runs helm with its state kept out of $HOME; never raises on a non-zero exit."""
        argv = [str(self.binary), *args]
        env = {
            **os.environ,
            "HELM_CACHE_HOME": str(self.state_dir / "cache"),
            "HELM_CONFIG_HOME": str(self.state_dir / "config"),
            "HELM_DATA_HOME": str(self.state_dir / "data"),
        }
        # Never fall back to ~/.kube/config: only the local control plane is ever a target.
        env.pop("KUBECONFIG", None)
        if kubeconfig is not None:
            argv.append(f"--kubeconfig={kubeconfig}")
        else:
            env["KUBECONFIG"] = str(self.state_dir / "no-cluster.kubeconfig")
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )

    def template(
        self,
        *set_args: str,
        release: str = "davit",
        namespace: str = "davit-system",
        values: dict[str, Any] | None = None,
        values_dir: Path | None = None,
        include_crds: bool = False,
    ) -> list[dict[str, Any]]:
        """``helm template`` with ``--set`` pairs (and an optional values file), parsed."""
        result = self.run(
            *self.template_args(
                *set_args,
                release=release,
                namespace=namespace,
                values=values,
                values_dir=values_dir,
                include_crds=include_crds,
            )
        )
        if result.returncode != 0:
            raise AssertionError(f"helm template failed:\n{result.stderr}")
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def template_args(
        self,
        *set_args: str,
        release: str = "davit",
        namespace: str = "davit-system",
        values: dict[str, Any] | None = None,
        values_dir: Path | None = None,
        include_crds: bool = False,
    ) -> list[str]:
        args = [
            "template",
            release,
            str(CHART),
            f"--namespace={namespace}",
            f"--kube-version={KUBE_VERSION}",
        ]
        if include_crds:
            args.append("--include-crds")
        if values is not None:
            if values_dir is None:
                raise ValueError("values need a values_dir to write the file into")
            path = values_dir / "values.yaml"
            path.write_text(yaml.safe_dump(values))
            args.append(f"--values={path}")
        for pair in set_args:
            args.append(f"--set={pair}")
        return args


def find(
    objects: Sequence[dict[str, Any]], kind: str, name: str | None = None
) -> list[dict[str, Any]]:
    """The rendered objects of one kind (and name, when given)."""
    return [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def only(objects: Sequence[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, rendered {len(found)}"
    return found[0]


Permission = tuple[str, str, str]


def permissions(rules: Sequence[dict[str, Any]]) -> set[Permission]:
    """RBAC rules flattened to (apiGroup, resource, verb) triples."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }
