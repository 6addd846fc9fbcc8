"""Each half imports on a path that holds only itself, the contract and its declared
dependencies, as in its own image: the operator without the engine or torch, the engine
without the operator or kopf.

The path is built from the installed distributions' metadata: the half's declared
requirements, followed recursively, each linked into a scratch folder by the top-level names
its files use. A module that imports something the half does not declare fails here.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OURS = {"davit": "cli", "davit-contract": "contract"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: md.Distribution) -> list[str]:
    """Requirement names that apply here (no extras, markers evaluated by pip's rules)."""
    names = []
    for text in dist.requires or []:
        requirement, _, marker = text.partition(";")
        if "extra" in marker:
            continue
        if marker.strip() and not _marker_holds(marker):
            continue
        names.append(re.split(r"[\s<>=!~\[(]", requirement.strip(), maxsplit=1)[0])
    return names


def _marker_holds(marker: str) -> bool:
    from packaging.markers import Marker

    return Marker(marker).evaluate()


def closure(root: str) -> set[str]:
    """The distribution and everything it needs, by canonical name."""
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional platform dependency that is not installed here
        todo.extend(_requirements(dist))
    return seen


def link_tree(names: set[str], into: Path) -> None:
    """Link every top-level file and folder of the named distributions into `into`."""
    for name in names:
        if name in OURS or name.startswith("davit-"):
            continue
        dist = md.distribution(name)
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            source = Path(str(dist.locate_file(top)))
            target = into / top
            if source.exists() and not target.exists():
                target.symlink_to(source)


def run_alone(tmp_path: Path, distribution: str, source_dir: str, probe: str) -> dict[str, object]:
    deps = tmp_path / "site"
    deps.mkdir()
    link_tree(closure(distribution), deps)
    paths = [
        sysconfig.get_path("stdlib"),
        sysconfig.get_path("platstdlib"),
        str(Path(sysconfig.get_path("stdlib")) / "lib-dynload"),
        str(deps),
        str(REPO / "contract"),
        str(REPO / source_dir),
    ]
    code = f"import sys; sys.path[:] = {paths!r}\n{probe}"
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


WALK = """
import importlib, json, pkgutil
import {package}
loaded = []
for info in pkgutil.walk_packages({package}.__path__, "{package}."):
    if info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
    loaded.append(info.name)
print(json.dumps({{"loaded": loaded, "modules": sorted(sys.modules)}}))
"""


@pytest.mark.slow
def test_the_operator_imports_without_the_engine(tmp_path: Path) -> None:
    seen = run_alone(tmp_path, "davit-operator", "operator", WALK.format(package="davit_operator"))
    modules = set(seen["modules"])  # type: ignore[arg-type]
    assert "davit_operator.handlers" in modules and "kopf" in modules
    leaked = {m.split(".")[0] for m in modules} & {"torch", "davit_engine", "triton", "fastapi"}
    assert not leaked, f"the operator loaded {sorted(leaked)}"


@pytest.mark.slow
def test_the_engine_imports_without_the_operator(tmp_path: Path) -> None:
    seen = run_alone(tmp_path, "davit-engine", "engine", WALK.format(package="davit_engine"))
    modules = set(seen["modules"])  # type: ignore[arg-type]
    assert "davit_engine.server.app" in modules and "torch" in modules
    assert "davit_contract.profile" in modules
    leaked = {m.split(".")[0] for m in modules} & {"davit_operator", "kopf", "kubernetes"}
    assert not leaked, f"the engine loaded {sorted(leaked)}"
