"""FP8 on the accelerator: refuse `engine.quantization: fp8`, `engine.kvCacheDtype: fp8` and
`engine.lmHeadQuantization: fp8` where the catalog marks the accelerator as lacking FP8 (e4m3) support.
`engine.lmHeadQuantization: int8` is no FP8 field: an int8 head runs on any accelerator.

Planning, not CEL: the facts live in the versioned catalog (`accelerators.yaml`) that the
operator loads at startup, while the CRD's rules are generated from the API types; a copy of
the catalog in CEL would drift from it. A product the catalog does not record passes: the
engine itself refuses FP8 at startup on a device without it (naming the flag).

A checkpoint that is FP8 itself (its shape says so: config.json's quantization_config, or the
shape catalog's `fp8Projections`) is refused the same way for the Davit engine, which serves
FP8 weights only on an accelerator with FP8, so the refusal comes at planning and not from a
crash-looping pod. Not for vLLM: whether a vLLM release serves FP8 checkpoints without FP8
arithmetic (weight-only kernels) was not checked against a release here, so its engine decides.
"""

from __future__ import annotations

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.loader import Catalog
from davit_operator.planning.errors import PlanError
from davit_operator.planning.memory import ModelShape

REASON = "UnsupportedByAccelerator"


def fp8_fields(spec: InferenceServiceSpec) -> list[str]:
    """The spec fields that ask for FP8, in spec order (an int8 LM head is not one)."""
    fields = []
    if spec.engine.quantization == "fp8":
        fields.append("engine.quantization")
    if spec.engine.lm_head_quantization == "fp8":
        fields.append("engine.lmHeadQuantization")
    if spec.engine.kv_cache_dtype == "fp8":
        fields.append("engine.kvCacheDtype")
    return fields


def check_fp8_accelerator(spec: InferenceServiceSpec, catalog: Catalog) -> None:
    """Raise PlanError (UnsupportedByAccelerator) naming the FP8 fields when the catalog marks
    the spec's accelerator (its product, else its vendor) as lacking FP8."""
    fields = fp8_fields(spec)
    if not fields:
        return
    lacking = _lacking(spec, catalog)
    if lacking is None:
        return
    which, instead = lacking
    raise PlanError(
        field=fields[0],
        value="fp8",
        reason=REASON,
        condition="",
        message=f"{' and '.join(f'{f} fp8' for f in fields)} need FP8 (e4m3) support, which "
        f"the catalog records {which} as lacking; remove {' and '.join(fields)}{instead}",
    )


def _lacking(spec: InferenceServiceSpec, catalog: Catalog) -> tuple[str, str] | None:
    """(the catalog's words for the spec's accelerator, the alternatives clause) when the
    catalog records it (its product, else its vendor) as lacking FP8; None otherwise."""
    accelerator = spec.accelerator
    vendor = catalog.accelerators.vendors[accelerator.vendor]
    if vendor.supports_fp8(accelerator.product) is not False:
        return None
    which = (
        f"accelerator.product {accelerator.product}"
        if accelerator.product is not None and accelerator.product in vendor.fp8
        else f"accelerator.vendor {accelerator.vendor}"
        + (f" (product {accelerator.product})" if accelerator.product else "")
    )
    products = vendor.fp8_products
    instead = (
        f", or set accelerator.product to one with FP8 ({', '.join(products)})" if products else ""
    )
    return which, instead


def check_fp8_checkpoint(
    spec: InferenceServiceSpec, catalog: Catalog, shape: ModelShape | None
) -> None:
    """Raise PlanError (UnsupportedByAccelerator) naming model.source when the Davit engine
    would serve an FP8 checkpoint (`shape.fp8_projections`) on an accelerator the catalog
    records as lacking FP8. A spec that also sets an FP8 field was refused already, by its
    field (`check_fp8_accelerator`)."""
    if spec.engine.type != "davit" or shape is None or not shape.fp8_projections:
        return
    lacking = _lacking(spec, catalog)
    if lacking is None:
        return
    which, instead = lacking
    raise PlanError(
        field="model.source",
        value=spec.model.source,
        reason=REASON,
        condition="",
        message=f"model.source {spec.model.source} is an FP8 checkpoint (its projections are "
        f"stored in e4m3), which the Davit engine serves only with FP8 (e4m3) support, and the "
        f"catalog records {which} as lacking it; serve an unquantized checkpoint of the "
        f"model{instead}",
    )
