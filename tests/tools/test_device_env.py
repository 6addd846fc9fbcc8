"""hack/device/env.sh: on the GPU machine, which has torch, Triton and transformers but none of
our distributions, the GPU tools run by module path from the working tree's folders.

The machine is imitated here: `python -S` (no site-packages) with only those three
distributions and what they need linked onto the path, then env.sh sourced.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.architecture.test_halves_alone import closure, link_tree

REPO = Path(__file__).resolve().parents[2]
ENV_SH = REPO / "hack" / "device" / "env.sh"
# What the GPU machine provides (see /work/.library/device/KINDS.md and docs/bench-notes.md).
DEVICE_DISTRIBUTIONS = ("torch", "triton", "transformers")
# Every tool that runs there, by the module path docs/bench-notes.md and docs/memory.md give.
DEVICE_TOOLS = (
    "davit_tools.bench.gpu_suite",
    "davit_tools.bench.kernel_timing",
    "davit_tools.bench.w2_kernels",
    "davit_tools.bench.memory_check",
    "davit_tools.bench.scheduler",
)


@pytest.mark.slow
def test_gpu_tools_run_by_module_path_with_only_the_device_packages(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    needed: set[str] = set()
    for name in DEVICE_DISTRIBUTIONS:
        needed |= closure(name)
    link_tree(needed, site)
    helps = " && ".join(f"python -S -m {module} --help >/dev/null" for module in DEVICE_TOOLS)
    # W3 starts the server as `python -m davit_cli`: the dispatcher must be found the same way.
    script = f". {ENV_SH} && {helps} && python -S -c 'import davit_cli' && echo $PYTHONPATH"
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(site),
        "HOME": str(tmp_path),
    }
    result = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,  # not the repository root: the path must come from env.sh alone
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    entries = result.stdout.strip().splitlines()[-1].split(":")
    folders = [str(REPO / name) for name in ("contract", "cli", "engine", "tools")]
    assert entries == [*folders, str(site)]
    assert str(REPO / "operator") not in entries
