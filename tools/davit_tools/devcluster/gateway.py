"""The Gateway API's and the Gateway API Inference Extension's CRDs, from their Go modules.

The upstream projects publish their CRD manifests inside their Go modules (`config/crd/`), so
the pinned release is fetched with `go mod download -json MODULE@VERSION` (the module proxy,
checksummed against the sum database) and the needed files are copied into a cache outside the
repository, keyed by version: `${DAVIT_CACHE:-~/.cache/davit}/gateway-crds/<module>@<version>/`.
A cached copy is reused without Go or network (a few milliseconds); a cold fetch downloads two
module zips (15 MB, about a second measured).

`python -m davit_tools.devcluster.gateway` fetches them and prints the files (hack/install.sh
runs it); tests apply the files to the local control plane.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .paths import cache_root


@dataclass(frozen=True)
class CrdModule:
    """A Go module and the CRD files inside it that the tests install."""

    module: str
    version_key: str  # the pin's key in versions.json
    files: tuple[str, ...]


MODULES = (
    CrdModule(
        "sigs.k8s.io/gateway-api",
        "gateway-api",
        (
            "config/crd/standard/gateway.networking.k8s.io_gatewayclasses.yaml",
            "config/crd/standard/gateway.networking.k8s.io_gateways.yaml",
            "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml",
        ),
    ),
    CrdModule(
        "sigs.k8s.io/gateway-api-inference-extension",
        "gateway-api-inference-extension",
        ("config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",),
    ),
)


class GatewayCrdError(RuntimeError):
    """A module could not be fetched (no Go toolchain, no module proxy)."""


def pinned(key: str) -> str:
    raw = json.loads(resources.files(__package__).joinpath("versions.json").read_text())
    return str(raw[key])


def _download(module: str, version: str) -> Path:
    cache_root().mkdir(parents=True, exist_ok=True)
    argv = ["go", "mod", "download", "-json", f"{module}@{version}"]
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=600, check=False, cwd=cache_root()
        )
    except FileNotFoundError as err:
        raise GatewayCrdError(f"`go` is not installed: cannot fetch {module}@{version}") from err
    try:
        info = json.loads(result.stdout)
    except json.JSONDecodeError:
        info = {}
    if result.returncode != 0 or not info.get("Dir"):
        reason = info.get("Error") or result.stderr.strip() or f"exit {result.returncode}"
        raise GatewayCrdError(f"go mod download {module}@{version} failed: {reason}")
    return Path(info["Dir"])


def crd_files() -> list[Path]:
    """The pinned CRD files, fetched into the cache when missing (GatewayCrdError if that
    fails)."""
    found: list[Path] = []
    for crd in MODULES:
        version = pinned(crd.version_key)
        dest = cache_root() / "gateway-crds" / f"{crd.module.replace('/', '_')}@{version}"
        wanted = [dest / Path(f).name for f in crd.files]
        if not all(p.is_file() for p in wanted):
            source = _download(crd.module, version)
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name in crd.files:
                shutil.copyfile(source / name, tmp / Path(name).name)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        found += wanted
    return found


def main() -> int:
    try:
        files = crd_files()
    except GatewayCrdError as err:
        print(f"gateway-crds: {err}", file=sys.stderr)
        return 1
    for path in files:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
