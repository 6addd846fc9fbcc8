"""Image resolution: engine type + version + variant (or an override) -> an exact artifact.

A version newer than every release of its engine in the catalog is uncatalogued: it is served
only with `engine.image` (the catalog has no image for it), planned with the facts of the newest
catalogued release (`assumed_release`), and reported in the `Uncatalogued` condition. Any other
version the catalog lacks is refused, naming the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.loader import Catalog, EngineInfo, Release
from davit_operator.planning.errors import image_error


@dataclass(frozen=True)
class ResolvedImage:
    """The artifact the pods run. `reference` is what goes into the container spec: by digest
    when a digest is known (tag kept for readers), else by tag."""

    reference: str
    repository: str
    tag: str | None
    digest: str | None
    variant: str
    engine_type: str
    engine_version: str
    release_title: str | None
    catalog_version: str
    source: Literal["catalog", "override"]
    # For an uncatalogued version: the catalog release whose facts planning assumed.
    assumed_release: str | None = None
    # For an engine.image override of a variant the catalog says its release never published:
    # what the catalog says (the override bypasses the catalog's address, not its facts).
    unpublished: str | None = None

    @property
    def pinned(self) -> bool:
        return self.digest is not None


def parse_reference(reference: str) -> tuple[str, str | None, str | None]:
    """Split REPOSITORY[:TAG][@sha256:DIGEST] into its parts (a registry port is not a tag)."""
    rest, _, digest = reference.partition("@")
    last_slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > last_slash:
        return rest[:colon], rest[colon + 1 :], digest or None
    return rest, None, digest or None


def default_variant(spec: InferenceServiceSpec, catalog: Catalog) -> str:
    """engine.variant, or the vendor's default variant when unset."""
    if spec.engine.variant is not None:
        return spec.engine.variant
    return catalog.accelerators.vendors[spec.accelerator.vendor].default_variant


def _engine_release(spec: InferenceServiceSpec, catalog: Catalog) -> tuple[EngineInfo, str]:
    engine = catalog.engines.engines[spec.engine.type]
    version = spec.engine.version
    if engine.release(version) is not None:
        return engine, version
    newest = engine.newest.version
    if engine.is_newer_than_catalog(version):
        if spec.engine.image is not None:
            return engine, version
        raise image_error(
            "engine.version",
            version,
            "UncataloguedVersion",
            f"engine.version {version} is newer than every {spec.engine.type} release in catalog "
            f"{catalog.version} (the newest is {newest}); set engine.image to its image to run it "
            f"uncatalogued (planned with {newest}'s runner rules and arguments, reported in the "
            f"Uncatalogued condition), or use engine.version {newest}",
        )
    raise image_error(
        "engine.version",
        version,
        "UnknownVersion",
        f"engine.version {version} is not a {spec.engine.type} release in catalog "
        f"{catalog.version}; known versions: {', '.join(engine.versions)}",
    )


def _unpublished(engine: EngineInfo, release: Release, variant: str) -> str | None:
    """What the catalog says when `release` never published `variant`, else None."""
    entry = release.images.get(variant)  # type: ignore[call-overload]
    if entry is None or entry.published:
        return None
    last = engine.last_publishing(variant, before=release.version)
    since = f"; it was last published in {last.version}" if last is not None else ""
    return f"{release.version} never published the {variant} variant{since}"


def resolve_image(spec: InferenceServiceSpec, catalog: Catalog) -> ResolvedImage:
    """Resolve the image, or raise PlanError naming the field and what would work instead."""
    engine, version = _engine_release(spec, catalog)
    release = engine.facts_for(version)
    assert release is not None
    assumed = release.version if release.version != version else None
    variant = default_variant(spec, catalog)
    policy_strict = spec.engine.image_policy == "Strict"
    title = release.title if release.title != release.tag and assumed is None else None

    if spec.engine.image is not None:
        repository, tag, digest = parse_reference(spec.engine.image)
        if policy_strict and digest is None:
            raise image_error(
                "engine.image",
                spec.engine.image,
                "UnpinnedImage",
                f"engine.imagePolicy Strict refuses engine.image {spec.engine.image}: it has no "
                "digest; use REPOSITORY@sha256:DIGEST or imagePolicy: Permissive",
            )
        return ResolvedImage(
            reference=spec.engine.image,
            repository=repository,
            tag=tag,
            digest=f"sha256:{digest.removeprefix('sha256:')}" if digest else None,
            variant=variant,
            engine_type=spec.engine.type,
            engine_version=version,
            release_title=title,
            catalog_version=catalog.version,
            source="override",
            assumed_release=assumed,
            unpublished=_unpublished(engine, release, variant) if assumed is None else None,
        )

    entry = release.images[variant]  # type: ignore[index]
    if not entry.published:
        last = engine.last_publishing(variant, before=version)
        vendor_variants = catalog.accelerators.vendors[spec.accelerator.vendor].variants
        alternatives = [v for v in vendor_variants if v != variant and release.images[v].published]
        instead = f"use engine.variant {' or '.join(alternatives)}" if alternatives else ""
        if last is not None:
            pin = f"pin engine.version <= {last.version}"
            instead = f"{instead} or {pin}" if instead else pin
            raise image_error(
                "engine.variant",
                variant,
                "VariantNotPublished",
                f"engine.variant {variant} is not published by {spec.engine.type} {version}; it "
                f"was last published in {last.version}; {instead}",
            )
        raise image_error(
            "engine.variant",
            variant,
            "VariantNotPublished",
            f"engine.variant {variant} is not published by {spec.engine.type} {version} nor any "
            f"earlier release in catalog {catalog.version}"
            + (f"; {instead}" if instead else "; set engine.image to an image you build"),
        )
    if not entry.is_recorded:
        raise image_error(
            "engine.variant",
            variant,
            "ImageNotRecorded",
            f"{spec.engine.type} {version} publishes the {variant} variant but catalog "
            f"{catalog.version} does not record its image repository and tag; set engine.image "
            "to the image you use",
        )
    assert entry.repository is not None
    if policy_strict and entry.digest is None:
        raise image_error(
            "engine.imagePolicy",
            "Strict",
            "UnpinnedImage",
            f"engine.imagePolicy Strict needs a digest, and catalog {catalog.version} records "
            f"none for {entry.repository}:{entry.tag}; set engine.image to "
            f"{entry.repository}@sha256:DIGEST or use imagePolicy: Permissive",
        )
    if entry.digest is not None:
        reference = f"{entry.repository}{':' + entry.tag if entry.tag else ''}@{entry.digest}"
    else:
        reference = f"{entry.repository}:{entry.tag}"
    return ResolvedImage(
        reference=reference,
        repository=entry.repository,
        tag=entry.tag,
        digest=entry.digest,
        variant=variant,
        engine_type=spec.engine.type,
        engine_version=version,
        release_title=title,
        catalog_version=catalog.version,
        source="catalog",
    )
