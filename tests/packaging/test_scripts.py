"""The shell scripts under hack/: shellcheck-clean, and tools.sh idempotent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .tools import REPO, TOOLS_SCRIPT, Tools

SCRIPTS = sorted((REPO / "hack").rglob("*.sh"))


@pytest.mark.parametrize(
    "script", SCRIPTS, ids=[str(s.relative_to(REPO / "hack")) for s in SCRIPTS]
)
def test_shellcheck_passes(packaging_tools: Tools, script: Path) -> None:
    result = subprocess.run(
        [str(packaging_tools.shellcheck), "--severity=style", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_tools_reinstall_nothing_when_cached(packaging_tools: Tools) -> None:
    # With the package index switched off, any download attempt would fail the script.
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    result = subprocess.run(
        ["bash", str(TOOLS_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == packaging_tools.helm.parent


def test_tools_are_the_pinned_versions(packaging_tools: Tools) -> None:
    def output(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout

    assert output(str(packaging_tools.helm), "version", "--short").startswith("v4.1.4")
    assert '"gitVersion": "v1.35.2"' in output(
        str(packaging_tools.kubectl), "version", "--client", "-o", "json"
    )
    assert "2.15.1" in output(str(packaging_tools.hadolint), "--version")
    assert "version: 0.11.0" in output(str(packaging_tools.shellcheck), "--version")
