"""What the release's default wheel was built against: CUDA, torch and triton.

- CUDA: the native extensions' DT_NEEDED `libcudart.so.N` (the CUDA major the wheel loads) and
  the `Cuda compilation tools, release X.Y` string nvcc leaves in the device code;
  requirements tagged `cu12`/`cu13` in METADATA agree or not.
- torch: the `Requires-Dist: torch==...` pin in the wheel's METADATA (and torchvision,
  torchaudio, triton when pinned there).
- What the torch pin implies: the pinned torch wheel's own METADATA (its `cuda-toolkit` and
  `triton` requirements), read through pip's installation report for that exact file (`pip
  install --dry-run --report`), which names the torch wheel and its sha256.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from davit_tools.catalog.elf import needed_libraries
from davit_tools.catalog.wheel import ReleaseWheel, parse_requirement

_NVCC = re.compile(rb"Cuda compilation tools, release (\d+\.\d+)")
_CUDART = re.compile(r"^libcudart\.so\.(\d+)$")
_CUDA_TAG = re.compile(r"cu(\d\d)\b")
PINNED = ("torch", "torchvision", "torchaudio", "triton")


@dataclass(frozen=True)
class NativeLibrary:
    """A native extension in the wheel: the CUDA runtime major it links and the nvcc releases
    named in its device code."""

    member: str
    cudart_major: int | None
    nvcc_releases: list[str]


def native_libraries(wheel: ReleaseWheel) -> list[NativeLibrary]:
    """Top-level native extensions of the package (`vllm/*.so`)."""
    found: list[NativeLibrary] = []
    for member in sorted(wheel.names):
        if not (member.startswith("vllm/") and member.count("/") == 1 and member.endswith(".so")):
            continue
        data = wheel.read_bytes(member)
        cudart = [int(m[1]) for lib in needed_libraries(data) if (m := _CUDART.match(lib))]
        releases = sorted({m.decode() for m in _NVCC.findall(data)})
        found.append(NativeLibrary(member, cudart[0] if cudart else None, releases))
    return found


def cuda_tagged_requirements(wheel: ReleaseWheel) -> list[str]:
    """Unconditional requirements whose name or extras carry a CUDA tag (`[cu13]`, `-cu13`)."""
    return sorted(
        f"{r.name}{r.extras}{r.specifier}"
        for r in wheel.requirements
        if r.is_unconditional and _CUDA_TAG.search(f"{r.name}{r.extras}")
    )


def pins(wheel: ReleaseWheel) -> dict[str, str | None]:
    """The version specifier of each of PINNED in METADATA (None when not required)."""
    out: dict[str, str | None] = {}
    for name in PINNED:
        requirement = wheel.requirement(name)
        out[name] = requirement.specifier if requirement is not None else None
    return out


@dataclass(frozen=True)
class TorchWheel:
    """The pinned torch wheel as the index offers it, and what its METADATA requires."""

    filename: str
    sha256: str
    cuda_toolkit: str | None
    triton: str | None
    requires: list[str]


def torch_wheel(torch_specifier: str, python_version: str = "3.12") -> TorchWheel:
    """Resolve `torch<specifier>` for manylinux x86_64 without installing it and read its
    METADATA requirements from pip's report."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-deps",
            "--ignore-installed",
            "--only-binary=:all:",
            "--platform",
            "manylinux_2_28_x86_64",
            "--python-version",
            python_version,
            "--target",
            str(Path(scratch) / "unused"),
            "--report",
            str(report),
            "--quiet",
            f"torch{torch_specifier}",
        ]
        subprocess.run(command, check=True, capture_output=True, text=True)
        entry = json.loads(report.read_text())["install"][0]
    requires: list[str] = entry["metadata"].get("requires_dist", [])
    toolkit = triton = None
    for line in requires:
        requirement = parse_requirement(line)
        if requirement.name == "cuda-toolkit":
            toolkit = requirement.specifier
        elif requirement.name == "triton":
            triton = requirement.specifier
    return TorchWheel(
        filename=entry["download_info"]["url"].rsplit("/", 1)[-1],
        sha256=entry["download_info"]["archive_info"]["hashes"]["sha256"],
        cuda_toolkit=toolkit,
        triton=triton,
        requires=sorted(r for r in requires if "extra ==" not in r),
    )
