"""One release's wheel: found in (or downloaded into) the wheel cache, read without installing.

A wheel is a zip file; everything the evidence says about a release is read from its members
(Python source, native libraries, `*.dist-info/METADATA`), so the wheel's file name and sha256
are the identity every fact refers to.
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from functools import cached_property
from pathlib import Path

DEFAULT_WHEEL_DIR = Path.home() / ".cache" / "davit" / "vllm-wheels"


class ReleaseNotPublished(LookupError):
    """The package index has no binary wheel for this version."""


@dataclass(frozen=True)
class Requirement:
    """One `Requires-Dist` line: the distribution name, its version specifier and marker."""

    name: str
    specifier: str
    marker: str
    extras: str

    @property
    def is_unconditional(self) -> bool:
        return not self.marker


_REQUIREMENT = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?P<extras>\[[^\]]*\])?\s*"
    r"(?P<spec>[^;]*?)\s*(?:;\s*(?P<marker>.*))?$"
)


def parse_requirement(line: str) -> Requirement:
    match = _REQUIREMENT.match(line.strip())
    if match is None:
        raise ValueError(f"not a requirement: {line!r}")
    return Requirement(
        name=match["name"],
        specifier=match["spec"].strip().strip("()"),
        marker=(match["marker"] or "").strip(),
        extras=match["extras"] or "",
    )


def normalize(name: str) -> str:
    """A distribution name in its canonical form (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class ReleaseWheel:
    """An opened wheel of `package` at `version`; members are read on demand and cached."""

    path: Path
    package: str = "vllm"
    _texts: dict[str, str] = field(default_factory=dict, repr=False)
    _trees: dict[str, ast.Module] = field(default_factory=dict, repr=False)

    @cached_property
    def _zip(self) -> zipfile.ZipFile:
        return zipfile.ZipFile(self.path)

    @property
    def filename(self) -> str:
        return self.path.name

    @cached_property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        with self.path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    @cached_property
    def names(self) -> frozenset[str]:
        return frozenset(self._zip.namelist())

    def has(self, member: str) -> bool:
        return member in self.names

    def read_bytes(self, member: str) -> bytes:
        return self._zip.read(member)

    def read_text(self, member: str) -> str:
        if member not in self._texts:
            self._texts[member] = self._zip.read(member).decode("utf-8")
        return self._texts[member]

    def tree(self, member: str) -> ast.Module:
        """The parsed module `member` (a path inside the wheel)."""
        if member not in self._trees:
            self._trees[member] = ast.parse(self.read_text(member), filename=member)
        return self._trees[member]

    def python_files(self, under: str) -> list[str]:
        return sorted(n for n in self.names if n.startswith(under) and n.endswith(".py"))

    @cached_property
    def dist_info(self) -> str:
        found = sorted(
            {n.split("/", 1)[0] for n in self.names if n.split("/", 1)[0].endswith(".dist-info")}
        )
        if len(found) != 1:
            raise ValueError(f"{self.filename}: expected one .dist-info folder, found {found}")
        return found[0]

    @cached_property
    def metadata(self) -> dict[str, list[str]]:
        """`*.dist-info/METADATA` headers, each name mapped to all its values."""
        message = HeaderParser().parsestr(self.read_text(f"{self.dist_info}/METADATA"))
        out: dict[str, list[str]] = {}
        for key, value in message.items():
            out.setdefault(key, []).append(value)
        return out

    @property
    def metadata_path(self) -> str:
        return f"{self.dist_info}/METADATA"

    @cached_property
    def version(self) -> str:
        return self.metadata["Version"][0]

    @cached_property
    def requirements(self) -> list[Requirement]:
        return [parse_requirement(line) for line in self.metadata.get("Requires-Dist", [])]

    def requirement(self, name: str) -> Requirement | None:
        """The unconditional requirement on distribution `name`, if the wheel declares one."""
        wanted = normalize(name)
        for requirement in self.requirements:
            if normalize(requirement.name) == wanted and requirement.is_unconditional:
                return requirement
        return None


def find_wheel(wheel_dir: Path, package: str, version: str) -> Path | None:
    """The manylinux x86_64 wheel of `package` `version` in `wheel_dir`, if cached."""
    candidates = sorted(wheel_dir.glob(f"{package}-{version}-*manylinux*x86_64.whl"))
    return candidates[0] if candidates else None


def download_wheel(wheel_dir: Path, package: str, version: str) -> Path:
    """Download the default (manylinux x86_64) wheel without dependencies into `wheel_dir`;
    raise ReleaseNotPublished when the index has no such wheel."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_28_x86_64",
        "--python-version",
        "3.12",
        "--dest",
        str(wheel_dir),
        f"{package}=={version}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        if "No matching distribution" in done.stderr or "Could not find a version" in done.stderr:
            raise ReleaseNotPublished(f"{package} {version}: no binary wheel on the index")
        raise RuntimeError(f"pip download {package}=={version} failed:\n{done.stderr[-2000:]}")
    path = find_wheel(wheel_dir, package, version)
    if path is None:
        raise RuntimeError(f"pip download {package}=={version} left no manylinux x86_64 wheel")
    return path


def open_release(wheel_dir: Path, version: str, package: str = "vllm") -> ReleaseWheel:
    """The cached wheel of `version`, downloaded first when it is not cached yet."""
    path = find_wheel(wheel_dir, package, version) or download_wheel(wheel_dir, package, version)
    wheel = ReleaseWheel(path, package)
    if wheel.version != version:
        raise ValueError(f"{path.name}: METADATA says version {wheel.version}, not {version}")
    return wheel
