"""A model's config.json over HTTP, for the pre-flight memory check of shapes the catalog lacks.

Optional and never required: only `hf://` sources, only when the operator was given a base URL
(`--model-config-url`, a model hub or a mirror of one), with a short timeout. Anything that goes
wrong (unreachable, 404, not a config) leaves the shape unknown and the check skipped; the
answer, good or bad, is remembered per source and revision for the life of the process.
"""

from __future__ import annotations

import logging

import httpx

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.planning.memory import (
    ModelShape,
    ShapeCatalog,
    ShapeError,
    shape_for,
    shape_from_config,
    with_shape,
)

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_SECONDS = 5.0


class ModelConfigSource:
    """Fetches `BASE/ORG/NAME/resolve/REVISION/config.json` once per source and revision."""

    def __init__(self, base_url: str, timeout: float = FETCH_TIMEOUT_SECONDS) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._known: dict[tuple[str, str], ModelShape | None] = {}

    async def shapes_for(self, spec: InferenceServiceSpec, catalog: ShapeCatalog) -> ShapeCatalog:
        """`catalog`, plus the fetched shape of `spec`'s model when the catalog lacks it."""
        scheme, _, repo = spec.model.source.partition("://")
        if scheme != "hf" or shape_for(spec, catalog) is not None:
            return catalog
        revision = spec.model.revision or "main"
        key = (repo, revision)
        if key not in self._known:
            self._known[key] = await self._fetch(repo, revision)
        shape = self._known[key]
        return with_shape(catalog, repo, shape) if shape is not None else catalog

    async def _fetch(self, repo: str, revision: str) -> ModelShape | None:
        url = f"{self.base_url}/{repo}/resolve/{revision}/config.json"
        try:
            async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=True) as client:
                response = await client.get(url)
            response.raise_for_status()
            shape = shape_from_config(response.json())
        except (httpx.HTTPError, ValueError) as exc:  # ShapeError and bad JSON are ValueErrors
            reason = exc if isinstance(exc, ShapeError) else type(exc).__name__
            logger.info("no model shape from %s (%s): the memory check is skipped", url, reason)
            return None
        logger.info("model shape of %s@%s read from %s", repo, revision, url)
        return shape
