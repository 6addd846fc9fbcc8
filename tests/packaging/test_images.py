"""Container recipes under images/: hadolint plus structural checks of every Dockerfile.

There is no container engine on the development and CI machines, so the recipes are never built
here; these tests hold them to the rules a build would otherwise reveal (pinned bases, non-root
user, OCI labels, multi-stage layout, the right entry point)."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.support import unavailable

from .dockerfile import Dockerfile, parse
from .tools import REPO, Tools

IMAGES = REPO / "images"
HADOLINT_CONFIG = IMAGES / "hadolint.yaml"
ENGINE_VARIANTS = ("cuda13.0", "rocm", "cpu", "xpu")
ENGINE_FILES = [IMAGES / "engine" / f"Dockerfile.{v}" for v in ENGINE_VARIANTS]
OPERATOR_FILE = IMAGES / "operator" / "Dockerfile"
ALL_FILES = [*ENGINE_FILES, OPERATOR_FILE]
CATALOG = REPO / "operator" / "davit_operator" / "catalog" / "engines.yaml"
OCI_FROM_ARGS = {
    "org.opencontainers.image.version": "VERSION",
    "org.opencontainers.image.revision": "REVISION",
    "org.opencontainers.image.source": "SOURCE",
}
# repository[:tag][@sha256:digest]; the tag must carry a version number, the digest is optional.
IMAGE_REF = re.compile(
    r"^(?P<repo>[a-z0-9]+(?:[._/-][a-z0-9]+)*)(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]*))?"
    r"(?:@(?P<digest>sha256:[a-f0-9]{64}))?$"
)


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(IMAGES)) for p in paths]


def project_version() -> str:
    return str(
        tomllib.loads((REPO / "engine" / "pyproject.toml").read_text())["project"]["version"]
    )


def test_engine_recipes_are_exactly_the_variants() -> None:
    found = sorted(p.name for p in (IMAGES / "engine").iterdir() if p.name.startswith("Dockerfile"))
    assert found == sorted(f"Dockerfile.{v}" for v in ENGINE_VARIANTS)


def test_every_published_catalog_variant_has_a_recipe() -> None:
    if not CATALOG.exists():
        unavailable(f"{CATALOG.relative_to(REPO)} is not in this checkout")
    catalog = yaml.safe_load(CATALOG.read_text())
    (release,) = [
        r for r in catalog["engines"]["davit"]["releases"] if r["version"] == project_version()
    ]
    published = {v: img for v, img in release["images"].items() if img["published"]}
    assert published, "the catalog publishes no image for this version"
    for variant, image in published.items():
        assert variant in ENGINE_VARIANTS, f"catalog publishes {variant}, images/ has no recipe"
        if image.get("tag"):
            assert image["tag"] == f"{project_version()}-{variant}"
    # The operator runs the engine with the catalog's command and probes its health path; the
    # image agrees on both.
    davit = catalog["engines"]["davit"]
    for path in ENGINE_FILES:
        final = parse(path).final
        entrypoint = final.last("ENTRYPOINT")
        assert entrypoint is not None and entrypoint.exec_form() == davit["command"]
        healthcheck = final.last("HEALTHCHECK")
        assert healthcheck is not None and f"{davit['health']['liveness']}'" in healthcheck.args


def test_engine_image_matches_the_pods_the_operator_builds() -> None:
    from davit_operator.planning.args import ENGINE_PORT, MODEL_CACHE_DIR

    for path in ENGINE_FILES:
        final = parse(path).final
        exposed = final.last("EXPOSE")
        assert exposed is not None and exposed.args == str(ENGINE_PORT)
        # The operator mounts a writable emptyDir at MODEL_CACHE_DIR; the image keeps every
        # cache it writes below it, so engines also run with a read-only root filesystem.
        env = " ".join(i.args for i in final.all("ENV"))
        for variable in ("HF_HOME", "TRITON_CACHE_DIR"):
            match = re.search(rf"{variable}=(\S+)", env)
            assert match and match.group(1).startswith(MODEL_CACHE_DIR + "/"), variable


@pytest.mark.parametrize("path", ALL_FILES, ids=ids(ALL_FILES))
def test_hadolint_passes(packaging_tools: Tools, path: Path) -> None:
    result = subprocess.run(
        [str(packaging_tools.hadolint), "--config", str(HADOLINT_CONFIG), "--no-color", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_what_the_rules_forbid(packaging_tools: Tools, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nUSER root\nRUN pip install torch\nCMD davit serve\n")
    result = subprocess.run(
        [str(packaging_tools.hadolint), "--config", str(HADOLINT_CONFIG), "--no-color", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    for rule in ("DL3007", "DL3002", "DL3013", "DL3025"):  # latest, root, unpinned pip, shell CMD
        assert rule in result.stdout, result.stdout


@pytest.mark.parametrize("path", ALL_FILES, ids=ids(ALL_FILES))
def test_multi_stage_with_named_stages(path: Path) -> None:
    dockerfile = parse(path)
    assert dockerfile.directives.get("syntax", "").startswith("docker/dockerfile:")
    assert len(dockerfile.stages) >= 2
    names = [s.name for s in dockerfile.stages]
    assert all(names) and len(set(names)) == len(names), names
    # The final stage takes the built virtual environment from an earlier stage: no build
    # toolchain or pip cache ends up in the image by accident.
    copies_from = {i.flags().get("from") for i in dockerfile.final.all("COPY")}
    assert copies_from & set(names[:-1]), "the final stage copies nothing from a build stage"
    assert not dockerfile.final.all("ADD")


@pytest.mark.parametrize("path", ALL_FILES, ids=ids(ALL_FILES))
def test_base_images_are_pinned_build_args(path: Path) -> None:
    dockerfile = parse(path)
    for stage in dockerfile.stages:
        match = re.fullmatch(r"\$\{?([A-Z_]+)\}?", stage.base)
        assert match, f"FROM {stage.base}: base images come from a build argument"
        default = dockerfile.global_args.get(match.group(1))
        assert default, f"build argument {match.group(1)} has no default"
        ref = IMAGE_REF.match(default)
        assert ref, f"{default} is not an image reference"
        assert ref["tag"] or ref["digest"], f"{default} names no tag or digest"
        assert ref["tag"] != "latest" and "latest" not in default
        assert ref["digest"] or re.search(r"\d", ref["tag"]), f"{default}: tag without a version"


@pytest.mark.parametrize("path", ALL_FILES, ids=ids(ALL_FILES))
def test_runs_as_numeric_non_root_user(path: Path) -> None:
    final = parse(path).final
    user = final.last("USER")
    assert user is not None, "the final stage sets no USER (root by default)"
    uid, _, gid = user.args.partition(":")
    assert uid.isdigit() and int(uid) > 0, f"USER {user.args}: numeric non-zero UID required"
    assert gid.isdigit() and int(gid) > 0, f"USER {user.args}: numeric non-zero GID required"
    # Nothing after USER switches back to root.
    after = [i for i in final.instructions if i.line > user.line]
    assert not [i for i in after if i.keyword == "USER"]


@pytest.mark.parametrize("path", ALL_FILES, ids=ids(ALL_FILES))
def test_oci_labels_come_from_build_args(path: Path) -> None:
    final = parse(path).final
    labels = final.labels()
    assert labels.get("org.opencontainers.image.title", "").startswith("davit-")
    stage_args = final.args()
    for label, arg in OCI_FROM_ARGS.items():
        assert labels.get(label) == f"${{{arg}}}", f"{label} must be set from ARG {arg}"
        # An ARG must be declared inside the stage to be visible to its LABEL.
        assert arg in stage_args, f"ARG {arg} is not declared in the final stage"
    assert stage_args["VERSION"] == project_version()


@pytest.mark.parametrize("path", ALL_FILES, ids=ids(ALL_FILES))
def test_healthcheck_and_stop_signal(path: Path) -> None:
    final = parse(path).final
    healthcheck = final.last("HEALTHCHECK")
    assert healthcheck is not None
    assert "CMD [" in healthcheck.args, "HEALTHCHECK uses the exec form"
    stop = final.last("STOPSIGNAL")
    # The engine drains in-flight requests on SIGTERM; kopf stops cleanly on it.
    assert stop is not None and stop.args == "SIGTERM"


@pytest.mark.parametrize("path", ENGINE_FILES, ids=ids(ENGINE_FILES))
def test_engine_recipe(path: Path) -> None:
    dockerfile = parse(path)
    variant = path.suffix.lstrip(".") if path.name.count(".") == 1 else path.name.split(".", 1)[1]
    final = dockerfile.final
    entrypoint = final.last("ENTRYPOINT")
    assert entrypoint is not None and entrypoint.exec_form() == ["davit", "serve"]
    assert final.labels()["dev.davit.accelerator"] == variant
    exposed = final.last("EXPOSE")
    assert exposed is not None and exposed.args == "8000"
    healthcheck = final.last("HEALTHCHECK")
    assert healthcheck is not None and "127.0.0.1:8000/health" in healthcheck.args
    build = dockerfile.stage("build")
    torch_version = build.args().get("TORCH_VERSION")
    assert torch_version and re.fullmatch(r"\d+\.\d+\.\d+", torch_version)
    runs = " ".join(i.args for i in build.all("RUN"))
    assert '"torch==${TORCH_VERSION}"' in runs
    assert "pip install ./contract ./cli ./engine" in runs
    # Writable caches live under one folder the operator can mount over a read-only root.
    env = " ".join(i.args for i in final.all("ENV"))
    assert "HF_HOME=/var/cache/davit/" in env and "TRITON_CACHE_DIR=/var/cache/davit/" in env


@pytest.mark.parametrize("variant", ["rocm", "xpu"])
def test_vendor_wheel_index_is_required_where_the_default_has_none(variant: str) -> None:
    build = parse(IMAGES / "engine" / f"Dockerfile.{variant}").stage("build")
    (install,) = [i for i in build.all("RUN") if "torch==" in i.args]
    assert install.args.startswith('test -n "$TORCH_INDEX_URL"')


def test_operator_recipe() -> None:
    dockerfile = parse(OPERATOR_FILE)
    final = dockerfile.final
    entrypoint = final.last("ENTRYPOINT")
    assert entrypoint is not None and entrypoint.exec_form() == ["davit", "operator"]
    runs = " ".join(i.args for s in dockerfile.stages for i in s.all("RUN"))
    # The operator image carries no torch and no engine source: only the contract, the
    # dispatcher and the operator distributions are installed.
    assert "pip install ./contract ./cli ./operator" in runs
    assert "torch" not in runs


def _copied_sources(path: Path) -> set[str]:
    sources = set()
    for stage in parse(path).stages:
        for copy in stage.all("COPY"):
            if "from" not in copy.flags():
                words = [w for w in shlex.split(copy.args) if not w.startswith("--")]
                sources.update(w.rstrip("/") for w in words[:-1])
    return sources


@pytest.mark.parametrize("path", ALL_FILES, ids=ids(ALL_FILES))
def test_each_image_carries_only_its_half(path: Path) -> None:
    half = "operator" if path == OPERATOR_FILE else "engine"
    assert _copied_sources(path) == {"contract", "cli", half}


@pytest.mark.parametrize("path", ALL_FILES, ids=ids(ALL_FILES))
def test_copied_sources_exist(path: Path) -> None:
    dockerfile: Dockerfile = parse(path)
    for stage in dockerfile.stages:
        for copy in stage.all("COPY"):
            if "from" in copy.flags():
                continue
            words = [w for w in shlex.split(copy.args) if not w.startswith("--")]
            for source in words[:-1]:
                assert (REPO / source).exists(), f"{path.name}: COPY {source} is not in the repo"
