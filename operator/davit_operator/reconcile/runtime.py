"""Per-process state shared by every reconcile."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import kopf

from davit_operator.builders.fetch_job import FetchSettings
from davit_operator.catalog.loader import Catalog
from davit_operator.kube import KubeClient
from davit_operator.model_config import ModelConfigSource
from davit_operator.profiling import ProfileCache

# The operator-wide opt-out of the model cache (`davit operator --model-cache emptyDir`).
EMPTY_DIR_CACHE = "emptyDir"

# How long an answer about which optional kinds the API server serves is reused: installing the
# Gateway API Inference Extension's CRDs takes effect within this time, without a restart.
SERVED_CHECK_SECONDS = 60.0

EventPoster = Callable[[kopf.Body, str, str, str], None]  # (body, type, reason, message)


def _kopf_event(body: kopf.Body, type: str, reason: str, message: str) -> None:
    kopf.event(body, type=type, reason=reason, message=message)


@dataclass
class Runtime:
    """Per-process state shared by the handlers through kopf's memo (kopf copies the operator's
    memo into each object's memo, so every handler sees the same Runtime). `post_event` is
    kopf's event poster in the operator and a recorder in tests."""

    catalog: Catalog
    kube: KubeClient
    post_event: EventPoster = _kopf_event
    # Profile engine memory once per identity before replicas start (davit_operator.profiling);
    # the operator's command line turns it on (--memory-profiling, the default there).
    profile_memory: bool = False
    # config.json over HTTP for shapes the catalog lacks (davit_operator.model_config).
    model_configs: ModelConfigSource | None = None
    profiles: ProfileCache = field(default_factory=ProfileCache)
    # The model cache claim for specs that name none (or EMPTY_DIR_CACHE); None: they must.
    model_cache: str | None = None
    fetch: FetchSettings = field(default_factory=FetchSettings)
    # (group/version, plural) -> (served, when asked, time.monotonic), for every object.
    served_kinds: dict[tuple[str, str], tuple[bool, float]] = field(default_factory=dict)

    async def serves(self, group_version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in `group_version`, asked at most once per
        SERVED_CHECK_SECONDS for the whole process."""
        key = (group_version, plural)
        now = time.monotonic()
        known = self.served_kinds.get(key)
        if known is None or now - known[1] > SERVED_CHECK_SECONDS:
            known = (await self.kube.serves(group_version, plural), now)
            self.served_kinds[key] = known
        return known[0]
