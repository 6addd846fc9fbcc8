"""The versioned catalog: engine releases, their images per variant, runners and accelerators.

The data lives in `engines.yaml` and `accelerators.yaml` next to this module (package data) and is loaded and validated once at startup by
`load_catalog()`; a malformed catalog stops the operator with the file and field at fault instead
of producing wrong Deployments later. Lookups are methods on the frozen models.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from davit_operator.api.spec import Quantization, SpeculativeMethod

RunnerName = Literal["v1", "v2"]
VariantName = Literal["cuda13.0", "cuda12.9", "rocm", "cpu", "xpu"]
FeatureName = Literal[
    "sequenceParallelism",
    "dualBatchOverlap",
    "elasticExpertParallelism",
    "customLogitsProcessors",
]


class CatalogError(ValueError):
    """The catalog data is malformed; the message names the file and the field."""


class _Data(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


def version_key(version: str) -> tuple[int, ...]:
    """Sort key of a MAJOR.MINOR.PATCH string."""
    return tuple(int(part) for part in version.split("."))


class VendorInfo(_Data):
    resource: str | None
    product_label: str | None
    node_marker_label: str | None
    variants: list[VariantName] = Field(min_length=1)
    tolerations: list[dict[str, str]] = Field(default_factory=list)
    # FP8 (e4m3) support by product label value; products not listed take `fp8Default`
    # (null: not recorded, the engine checks the device at startup).
    fp8: dict[str, bool] = Field(default_factory=dict)
    fp8_default: bool | None = None

    @property
    def default_variant(self) -> VariantName:
        return self.variants[0]

    def supports_fp8(self, product: str | None) -> bool | None:
        """True or False where the catalog records it for `product` (or the vendor's
        unlisted products), None where it does not."""
        if product is not None and product in self.fp8:
            return self.fp8[product]
        return self.fp8_default

    @property
    def fp8_products(self) -> list[str]:
        return [product for product, supported in self.fp8.items() if supported]


class AcceleratorCatalog(_Data):
    schema_version: Literal[1]
    vendors: dict[Literal["nvidia", "amd", "intel", "cpu"], VendorInfo]

    @model_validator(mode="after")
    def _every_vendor(self) -> AcceleratorCatalog:
        missing = {"nvidia", "amd", "intel", "cpu"} - set(self.vendors)
        if missing:
            raise ValueError(f"vendors: missing {sorted(missing)}")
        return self


class ImageEntry(_Data):
    published: bool
    repository: str | None = None
    tag: str | None = None
    digest: str | None = Field(default=None, pattern=r"^sha256:[a-f0-9]{64}$")

    @model_validator(mode="after")
    def _consistent(self) -> ImageEntry:
        if not self.published and (self.repository or self.tag or self.digest):
            raise ValueError("an unpublished variant cannot name a repository, tag or digest")
        if self.repository and not (self.tag or self.digest):
            raise ValueError(f"repository {self.repository} needs a tag or a digest")
        if (self.tag or self.digest) and not self.repository:
            raise ValueError("a tag or digest needs a repository")
        return self

    @property
    def is_recorded(self) -> bool:
        return self.repository is not None


class RunnerSelection(_Data):
    kind: Literal["flag", "env"]
    name: str
    values: dict[RunnerName, str] = Field(default_factory=dict)


class RunnerInfo(_Data):
    variants: list[VariantName]
    unsupported_features: list[FeatureName]
    unsupported_speculative_methods: list[str]
    unsupported_models_by_variant: dict[VariantName, list[str]]


class Capabilities(_Data):
    """What an engine release itself serves, whichever runner runs it (the runner matrix is
    `RunnerInfo`). An unset size limit or speculative method list means the catalog records no
    limit; the default is a release with no limits recorded."""

    max_tensor_parallel: int | None = Field(default=None, ge=1)
    max_pipeline_parallel: int | None = Field(default=None, ge=1)
    max_data_parallel: int | None = Field(default=None, ge=1)
    # KV offload tiers (features.kvCacheOffloading) the release implements; none recorded:
    # the spec is refused.
    kv_offloading: list[Literal["cpu", "disk"]] = Field(default_factory=list)
    expert_parallel: bool = True
    unsupported_features: list[FeatureName] = Field(default_factory=list)
    speculative_methods: list[SpeculativeMethod] | None = None
    # engine.quantization / engine.kvCacheDtype values the release implements (null: no
    # record, nothing refused).
    quantization: list[Quantization] | None = None
    kv_cache_dtypes: list[Literal["fp8"]] | None = None


class Health(_Data):
    liveness: str
    readiness: str
    metrics: str


class Release(_Data):
    version: str = Field(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")
    tag: str
    title: str
    runners: list[RunnerName] = Field(min_length=1)
    default_runner: RunnerName
    deprecated_runners: list[RunnerName]
    images: dict[VariantName, ImageEntry]
    capabilities: Capabilities = Field(default_factory=Capabilities)

    @model_validator(mode="after")
    def _consistent(self) -> Release:
        if self.default_runner not in self.runners:
            raise ValueError(f"defaultRunner {self.default_runner} is not in runners")
        missing = {"cuda13.0", "cuda12.9", "rocm", "cpu", "xpu"} - set(self.images)
        if missing:
            raise ValueError(f"images: every variant must be listed, missing {sorted(missing)}")
        return self


class EngineInfo(_Data):
    display_name: str
    command: list[str] = Field(min_length=1)
    health: Health
    runner_selection: RunnerSelection
    runners: dict[RunnerName, RunnerInfo]
    releases: list[Release] = Field(min_length=1)

    @model_validator(mode="after")
    def _ordered(self) -> EngineInfo:
        versions = [release.version for release in self.releases]
        if versions != sorted(versions, key=version_key) or len(set(versions)) != len(versions):
            raise ValueError(f"releases must be unique and in ascending order, got {versions}")
        return self

    def release(self, version: str) -> Release | None:
        return next((r for r in self.releases if r.version == version), None)

    @property
    def versions(self) -> list[str]:
        return [release.version for release in self.releases]

    def last_publishing(self, variant: str, before: str) -> Release | None:
        """The newest release older than `before` that published `variant`."""
        older = [r for r in self.releases if version_key(r.version) < version_key(before)]
        published = [r for r in older if r.images[variant].published]  # type: ignore[index]
        return published[-1] if published else None

    def first_without(self, runner: RunnerName) -> Release | None:
        """The first release that no longer has `runner` after an earlier one had it."""
        seen = False
        for release in self.releases:
            if runner in release.runners:
                seen = True
            elif seen:
                return release
        return None

    def last_with(self, runner: RunnerName, before: str) -> Release | None:
        """The newest release older than `before` that still has `runner`."""
        candidates = [
            r
            for r in self.releases
            if runner in r.runners and version_key(r.version) < version_key(before)
        ]
        return candidates[-1] if candidates else None


class EngineCatalog(_Data):
    schema_version: Literal[1]
    catalog_version: str
    engines: dict[Literal["davit", "vllm"], EngineInfo]


class Catalog(BaseModel):
    """Both catalog files, validated together."""

    model_config = ConfigDict(frozen=True)

    engines: EngineCatalog
    accelerators: AcceleratorCatalog

    @property
    def version(self) -> str:
        return self.engines.catalog_version


def _read(path: Path | resources.abc.Traversable) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML: {exc}") from exc


def load_catalog(directory: Path | None = None) -> Catalog:
    """Load and validate `engines.yaml` and `accelerators.yaml` from `directory` (default: the
    packaged data). Raises CatalogError naming the file and field at fault."""
    base: Path | resources.abc.Traversable = (
        directory if directory is not None else resources.files(__package__)
    )
    engines_file = base / "engines.yaml"
    accelerators_file = base / "accelerators.yaml"
    try:
        engines = EngineCatalog.model_validate(_read(engines_file))
    except ValidationError as exc:
        raise CatalogError(f"{engines_file}: {exc}") from exc
    try:
        accelerators = AcceleratorCatalog.model_validate(_read(accelerators_file))
    except ValidationError as exc:
        raise CatalogError(f"{accelerators_file}: {exc}") from exc
    return Catalog(engines=engines, accelerators=accelerators)


@cache
def default_catalog() -> Catalog:
    """The packaged catalog, loaded once per process."""
    return load_catalog()
