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
MODELOPT_QUANT_CONFIG = "hf_quant_config.json"


class ModelConfigSource:
    """Fetches `BASE/ORG/NAME/resolve/REVISION/config.json` once per source and revision (and
    hf_quant_config.json beside it where config.json has no quantization_config)."""

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
                config = response.json()
                if isinstance(config, dict) and config.get("quantization_config") is None:
                    quant = await self._modelopt_settings(client, repo, revision)
                    if quant is not None:
                        config = {**config, "quantization_config": quant}
            shape = shape_from_config(config)
        except (httpx.HTTPError, ValueError) as exc:  # ShapeError and bad JSON are ValueErrors
            reason = exc if isinstance(exc, ShapeError) else type(exc).__name__
            logger.info("no model shape from %s (%s): the memory check is skipped", url, reason)
            return None
        logger.info("model shape of %s@%s read from %s", repo, revision, url)
        return shape

    async def _modelopt_settings(
        self, client: httpx.AsyncClient, repo: str, revision: str
    ) -> dict[str, object] | None:
        """hf_quant_config.json, where ModelOpt exports before it wrote quantization_config into
        config.json keep theirs (the engine reads it the same way); None where the repository
        has none or it cannot be read, so the weights count at the model dtype."""
        url = f"{self.base_url}/{repo}/resolve/{revision}/{MODELOPT_QUANT_CONFIG}"
        try:
            response = await client.get(url)
            if response.status_code == 404:
                return None
            response.raise_for_status()
            quant = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.info("%s unread (%s): weights count at the model dtype", url, exc)
            return None
        return quant if isinstance(quant, dict) else None
