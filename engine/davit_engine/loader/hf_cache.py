"""Model sources named as Hugging Face repositories (`hf://ORG/NAME` or `ORG/NAME`), resolved
offline from the local Hugging Face cache. The engine never downloads: a repository must be in
the cache already (pre-fetched into `HF_HOME`, for example by an init container).

Cache layout (the hub library's): `<cache>/models--ORG--NAME/refs/<revision>` holds a commit
hash, `<cache>/models--ORG--NAME/snapshots/<commit>/` the files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from davit_engine.types import ParamError

HF_PREFIX = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir() -> Path:
    """Where the hub library keeps repositories: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit)
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def repo_id_of(model: str) -> str | None:
    """The ORG/NAME a model source names, or None for a local path or `random:` shape.

    `hf://ORG/NAME` always names a repository; a bare `ORG/NAME` does only when no such local
    path exists.
    """
    if model.startswith(HF_PREFIX):
        repo = model.removeprefix(HF_PREFIX).strip("/")
        if not _REPO_ID.match(repo):
            raise ParamError("model", f"{model}: expected hf://ORG/NAME")
        return repo
    if _REPO_ID.match(model) and not Path(model).exists():
        return model
    return None


def resolve_snapshot(repo_id: str, revision: str | None, cache: Path | None = None) -> Path:
    """The cached snapshot directory of `repo_id` at `revision` (default `main`).

    Raises ParamError("model") naming the repository, the revision, the cache looked in, and
    how to get the files there.
    """
    cache = cache if cache is not None else hub_cache_dir()
    revision = revision or "main"
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    how = (
        f"this engine does not download models: put {repo_id} (revision {revision}) into the "
        f"Hugging Face cache first (`huggingface-cli download {repo_id} --revision {revision}` "
        "with HF_HOME pointing at the same cache), or serve a local directory or a pvc:// source; "
        "under the Davit operator, check the InferenceService's spec.model.source and "
        "spec.model.revision (the operator fetches them into spec.model.cache before any "
        "replica starts)"
    )
    if not repo_dir.is_dir():
        raise ParamError("model", f"{repo_id} is not in the Hugging Face cache at {cache}; {how}")
    commit = revision
    if not _COMMIT.match(revision):
        ref = repo_dir / "refs" / revision
        if not ref.is_file():
            raise ParamError(
                "--revision",
                f"{repo_id} is cached at {repo_dir} but not at revision {revision!r}; {how}",
            )
        commit = ref.read_text().strip()
    snapshot = repo_dir / "snapshots" / commit
    if not (snapshot / "config.json").is_file():
        raise ParamError(
            "model",
            f"{repo_id} revision {revision} ({commit}) has no config.json in the cache at "
            f"{snapshot}; {how}",
        )
    return snapshot
