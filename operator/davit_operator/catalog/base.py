"""Names and the base model shared by the catalog's data classes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

RunnerName = Literal["v1", "v2"]
VariantName = Literal["cuda13.0", "cuda12.9", "rocm", "cpu", "xpu"]
VARIANTS: tuple[VariantName, ...] = ("cuda13.0", "cuda12.9", "rocm", "cpu", "xpu")
FeatureName = Literal[
    "sequenceParallelism",
    "dualBatchOverlap",
    "elasticExpertParallelism",
    "customLogitsProcessors",
]


class CatalogModel(BaseModel):
    """Catalog data: camelCase keys, unknown keys refused, frozen."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


def version_key(version: str) -> tuple[int, ...]:
    """Sort key of a MAJOR.MINOR.PATCH string."""
    return tuple(int(part) for part in version.split("."))
