"""The contract check: the operator's command lines parsed by a release's own `vllm serve`.

For one release: a throwaway virtual environment outside the repository; the release's wheel
installed with `--no-deps`; then only what importing its CLI needs, found by running the check
and installing the distribution of each module it reports missing, one at a time, each with the
version the release's METADATA requires (every install is constrained by all of the release's
unconditional pins, so a dependency pulled in along the way gets the release's version too).
torch is the release's pinned CUDA build, with the CUDA libraries it requires to import. Then
`parse_driver.py` runs each command line through the release's CLI entry point (see there).
The environment is deleted afterwards; pip's download cache keeps the files for the next run.

Limits: nothing here has a GPU or the model, so the check stops after the release's CLI
validation and the construction of its engine arguments; what the release decides while
building its engine config (runner choice, model-dependent checks) is not exercised.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from davit_tools.catalog.command_lines import CommandLine
from davit_tools.catalog.wheel import ReleaseWheel, normalize

DEFAULT_WORK_DIR = Path.home() / ".cache" / "davit" / "vllm-evidence"
DRIVER = Path(__file__).with_name("parse_driver.py")
MAX_INSTALLS = 80
# No GPU here: the release's own way to pick its CPU platform instead of failing to detect one
# (the platform gives the parser its device defaults; flag names and validation do not depend
# on it).
DRIVER_ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": os.environ.get("HOME", "/root"),
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
}
# Import names whose distribution is named differently.
DISTRIBUTIONS = {
    "zmq": "pyzmq",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "google": "protobuf",
    "cv2": "opencv-python-headless",
    "attr": "attrs",
    "dateutil": "python-dateutil",
    "cpuinfo": "py-cpuinfo",
    "jwt": "pyjwt",
    "sklearn": "scikit-learn",
    "multipart": "python-multipart",
    "dotenv": "python-dotenv",
    "grpc": "grpcio",
    "git": "gitpython",
    "lm_format_enforcer": "lm-format-enforcer",
    "mistral_common": "mistral-common",
}


class CheckError(RuntimeError):
    """The environment could not be completed; the message says what was missing."""


@dataclass
class ParserCheck:
    """The outcome for one release: what was installed, how, and each line's result."""

    python: str
    installed: list[str] = field(default_factory=list)
    install_steps: list[str] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


def _run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)


def _constraints(wheel: ReleaseWheel) -> list[str]:
    """The release's unconditional version pins, without extras (pip constraints take none)."""
    lines = []
    for requirement in wheel.requirements:
        if requirement.is_unconditional and requirement.specifier:
            lines.append(f"{requirement.name}{requirement.specifier}")
    return sorted(lines)


def _requirement_for(wheel: ReleaseWheel, module: str) -> str:
    """What to install for a missing top-level `module`: the release's own requirement line
    (name, extras, version) when it declares the distribution, else the distribution name."""
    distribution = DISTRIBUTIONS.get(module, module.replace("_", "-"))
    for requirement in wheel.requirements:
        if normalize(requirement.name) == normalize(distribution) and (
            requirement.is_unconditional or "extra ==" not in requirement.marker
        ):
            return f"{requirement.name}{requirement.specifier}"
    return distribution


def _frozen(line: str) -> str:
    """A `pip freeze` line, a local file reference reduced to the file's name."""
    name, separator, location = line.partition(" @ ")
    return f"{name} @ {location.rsplit('/', 1)[-1]}" if separator else line


def check_release(
    wheel: ReleaseWheel,
    lines: list[CommandLine],
    work_dir: Path = DEFAULT_WORK_DIR,
    keep_env: bool = False,
) -> ParserCheck:
    """Parse `lines` with `wheel`'s own CLI in a throwaway environment under `work_dir`
    (`keep_env`: in `work_dir/env-vllm-VERSION`, kept and reused by the next run)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    if keep_env:
        kept = work_dir / f"env-vllm-{wheel.version}"
        kept.mkdir(exist_ok=True)
        return _check(wheel, lines, kept)
    scratch = Path(tempfile.mkdtemp(prefix=f"vllm-{wheel.version}-", dir=work_dir))
    try:
        return _check(wheel, lines, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check(wheel: ReleaseWheel, lines: list[CommandLine], scratch: Path) -> ParserCheck:
    venv = scratch / "venv"
    python = str(venv / "bin" / "python")
    if not Path(python).exists():
        done = _run([sys.executable, "-m", "venv", str(venv)])
        if done.returncode != 0:
            raise CheckError(f"venv: {done.stderr}")
    constraints = scratch / "constraints.txt"
    constraints.write_text("\n".join(_constraints(wheel)) + "\n")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    outcome = ParserCheck(python=_run([python, "--version"]).stdout.strip())

    done = _run([*pip, "--no-deps", str(wheel.path)])
    if done.returncode != 0:
        raise CheckError(f"installing {wheel.filename}: {done.stderr[-2000:]}")
    outcome.install_steps.append(f"pip install --no-deps {wheel.filename}")

    lines_file = scratch / "lines.json"
    lines_file.write_text(
        json.dumps([{"name": line.name, "args": line.args, "env": line.env} for line in lines])
    )
    results_file = scratch / "results.json"
    driver = scratch / DRIVER.name
    shutil.copy(DRIVER, driver)
    tried: set[str] = set()
    for _ in range(MAX_INSTALLS):
        done = _run(
            [python, str(driver), str(lines_file), str(results_file)], cwd=scratch, env=DRIVER_ENV
        )
        if done.returncode != 0 or not results_file.exists():
            raise CheckError(f"parse driver failed:\n{done.stderr[-3000:]}")
        results = json.loads(results_file.read_text())
        if "environment_error" in results:
            raise CheckError(f"importing the CLI failed:\n{results['environment_error']}")
        if "missing_module" not in results:
            outcome.results = results
            break
        module = str(results["missing_module"]).split(".", 1)[0]
        requirement = _requirement_for(wheel, module)
        if requirement in tried:
            raise CheckError(f"{module} still missing after installing {requirement}")
        tried.add(requirement)
        done = _run([*pip, "--constraint", str(constraints), requirement])
        if done.returncode != 0:
            raise CheckError(f"installing {requirement}: {done.stderr[-2000:]}")
        outcome.install_steps.append(f"missing module {module}: pip install {requirement}")
        print(f"  {wheel.version}: {outcome.install_steps[-1]}", file=sys.stderr, flush=True)
    else:
        raise CheckError(f"more than {MAX_INSTALLS} installs and the CLI still does not import")
    freeze = _run([python, "-m", "pip", "freeze", "--disable-pip-version-check"])
    outcome.installed = sorted(
        _frozen(line) for line in freeze.stdout.splitlines() if line and not line.startswith("#")
    )
    return outcome
