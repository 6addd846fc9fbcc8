"""The versioned catalog: engine releases, their images per variant, runners and accelerators.

The data lives in `engines.yaml` and `accelerators.yaml` next to this module (package data) and
is loaded and validated once at startup by `load_catalog()`; a malformed catalog stops the
operator with the file and field at fault instead of producing wrong Deployments later. Lookups
are methods on the frozen models. Runner rules are in `rules.py`.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from davit_operator.api.spec import LmHeadQuantization, Quantization, SpeculativeMethod
from davit_operator.catalog.base import (
    VARIANTS,
    CatalogModel,
    FeatureName,
    RunnerName,
    VariantName,
    version_key,
)
from davit_operator.catalog.rules import TWO_RUNNER_EFFECTS, RunnerRule, RunnerSwitch

__all__ = [
    "AcceleratorCatalog",
    "Capabilities",
    "Catalog",
    "CatalogError",
    "EngineCatalog",
    "EngineInfo",
    "FeatureName",
    "Health",
    "ImageEntry",
    "Release",
    "RunnerName",
    "VariantName",
    "default_catalog",
    "load_catalog",
    "version_key",
]


class CatalogError(ValueError):
    """The catalog data is malformed; the message names the file and the field."""


class VendorInfo(CatalogModel):
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


class AcceleratorCatalog(CatalogModel):
    schema_version: Literal[1]
    vendors: dict[Literal["nvidia", "amd", "intel", "cpu"], VendorInfo]

    @model_validator(mode="after")
    def _every_vendor(self) -> AcceleratorCatalog:
        missing = {"nvidia", "amd", "intel", "cpu"} - set(self.vendors)
        if missing:
            raise ValueError(f"vendors: missing {sorted(missing)}")
        return self


class ImageEntry(CatalogModel):
    """One image variant of a release. `source` names the entry of the catalog's `sources`
    this comes from: no image fact here is verified against an artifact."""

    published: bool
    repository: str | None = None
    tag: str | None = None
    digest: str | None = Field(default=None, pattern=r"^sha256:[a-f0-9]{64}$")
    source: str

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


class Capabilities(CatalogModel):
    """What an engine release itself serves, whichever runner runs it (the runner matrix is
    the release's `runnerRules`). An unset size limit or speculative method list means the
    catalog records no limit; the default is a release with no limits recorded."""

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
    # engine.lmHeadQuantization values (fp8, int8): the Davit engine's own flag, so a release
    # implements a value only where it lists it (empty: every value refused).
    lm_head_quantization: list[LmHeadQuantization] = Field(default_factory=list)


class SequenceParallelismArgs(CatalogModel):
    """The release's compilation pass-config key that turns sequence parallelism on."""

    pass_config_key: str = Field(pattern=r"^[a-z_]+$")


class ReleaseArguments(CatalogModel):
    """Release-specific spellings of engine arguments. `sequenceParallelism: null`: the release
    has no such setting (and its capabilities must list the feature as unsupported)."""

    sequence_parallelism: SequenceParallelismArgs | None = None


class WheelFacts(CatalogModel):
    """Facts of the release's default wheel, verified against it through the evidence file
    (`tests/operator/catalog/test_catalog_evidence.py` checks they agree)."""

    sha256: str = Field(pattern=r"^[a-f0-9]{64}$")
    cuda: str
    torch: str


class Health(CatalogModel):
    liveness: str
    readiness: str
    metrics: str


class Release(CatalogModel):
    version: str = Field(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")
    tag: str
    title: str
    tag_source: str
    runners: list[RunnerName] = Field(min_length=1)
    default_runner: RunnerName
    deprecated_runners: list[RunnerName]
    runner_switch: RunnerSwitch | None
    runner_rules: list[RunnerRule] = Field(default_factory=list)
    evidence: str | None = None
    wheel: WheelFacts | None = None
    arguments: ReleaseArguments = Field(default_factory=ReleaseArguments)
    images: dict[VariantName, ImageEntry]
    capabilities: Capabilities = Field(default_factory=Capabilities)

    @model_validator(mode="after")
    def _consistent(self) -> Release:
        if self.default_runner not in self.runners:
            raise ValueError(f"defaultRunner {self.default_runner} is not in runners")
        if not set(self.deprecated_runners) <= set(self.runners):
            raise ValueError("deprecatedRunners must be runners of the release")
        missing = set(VARIANTS) - set(self.images)
        if missing:
            raise ValueError(f"images: every variant must be listed, missing {sorted(missing)}")
        if len(self.runners) > 1 and self.runner_switch is None:
            raise ValueError("a release with two runners needs a runnerSwitch")
        switch = self.runner_switch
        if switch is not None and switch.kind == "env" and set(switch.values) != set(self.runners):
            raise ValueError(f"runnerSwitch.values must name every runner {self.runners}")
        texts = [rule.text for rule in self.runner_rules]
        if len(set(texts)) != len(texts):
            raise ValueError("runnerRules: a text is listed twice")
        for rule in self.runner_rules:
            two = TWO_RUNNER_EFFECTS & set(rule.effects)
            if len(self.runners) == 1 and two:
                raise ValueError(f"{rule.text}: {sorted(two)} need two runners; use refused")
            if len(self.runners) > 1 and "refused" in rule.effects:
                raise ValueError(f"{rule.text}: refused is for single-runner releases")
        if (
            self.arguments.sequence_parallelism is None
            and "sequenceParallelism" not in self.capabilities.unsupported_features
        ):
            raise ValueError(
                "arguments.sequenceParallelism is null: capabilities.unsupportedFeatures must "
                "list sequenceParallelism"
            )
        if self.evidence is not None and self.wheel is None:
            raise ValueError("a release with an evidence file records its wheel facts")
        return self


class EngineInfo(CatalogModel):
    display_name: str
    command: list[str] = Field(min_length=1)
    health: Health
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

    @property
    def newest(self) -> Release:
        return self.releases[-1]

    def is_newer_than_catalog(self, version: str) -> bool:
        """Whether `version` is newer than every release of this engine in the catalog."""
        return version_key(version) > version_key(self.newest.version)

    def facts_for(self, version: str) -> Release | None:
        """The release whose facts apply to `version`: its own, or for a version newer than the
        catalog's newest release that newest one (assumed, see planning/image.py); None for an
        unknown version inside the catalog's range."""
        if self.is_newer_than_catalog(version):
            return self.newest
        return self.release(version)

    def last_publishing(self, variant: str, before: str) -> Release | None:
        """The newest release older than `before` that published `variant`."""
        older = [r for r in self.releases if version_key(r.version) < version_key(before)]
        published = [r for r in older if r.images[variant].published]  # type: ignore[index]
        return published[-1] if published else None

    def last_with(self, runner: RunnerName, before: str) -> Release | None:
        """The newest release older than `before` that still ships `runner`."""
        candidates = [
            r
            for r in self.releases
            if runner in r.runners and version_key(r.version) < version_key(before)
        ]
        return candidates[-1] if candidates else None


class EngineCatalog(CatalogModel):
    schema_version: Literal[2]
    catalog_version: str
    sources: dict[str, str] = Field(min_length=1)
    engines: dict[Literal["davit", "vllm"], EngineInfo]

    @model_validator(mode="after")
    def _sources_named(self) -> EngineCatalog:
        for engine_type, engine in self.engines.items():
            for release in engine.releases:
                named = [release.tag_source] + [e.source for e in release.images.values()]
                unknown = sorted(set(named) - set(self.sources))
                if unknown:
                    raise ValueError(
                        f"{engine_type} {release.version}: unknown sources {unknown}; "
                        f"known: {sorted(self.sources)}"
                    )
        return self


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
