"""FP8 in the operator: engine.quantization and engine.kvCacheDtype become upstream's flags for
both engine types (parsed by the Davit engine's own parser), the memory estimate counts one
byte per FP8 element, the identity changes only when they are set, and planning refuses them
on accelerators the catalog records without FP8 and on releases that do not implement them.
engine.lmHeadQuantization (fp8 or int8, one byte per head weight either way) is the Davit
engine's own flag; only its fp8 value needs FP8."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from pydantic import ValidationError

from davit_engine.config import LM_HEAD_QUANTIZATIONS
from davit_engine.server.cli import build_parser
from davit_operator.api.spec import OWNED_FLAGS, EngineSpec, LmHeadQuantization
from davit_operator.catalog.loader import Catalog, load_catalog
from davit_operator.planning.errors import PlanError
from davit_operator.planning.memory import (
    ONE_BYTE_LM_HEADS,
    Precision,
    effective_limits,
    estimate_memory,
    identity_hash,
    load_shape_catalog,
    profile_identity,
    weight_bytes,
)
from davit_operator.planning.plan import make_plan
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
SHAPES = load_shape_catalog()
FP8_BOTH = {"engine": {"quantization": "fp8", "kvCacheDtype": "fp8"}}
RANDOM_8B = {"model": {"source": "random://llama-3.1-8b", "revision": None}}


def _args(**overrides: Any) -> list[str]:
    return make_plan("svc", "ns", make_spec(**overrides), CATALOG).invocation.args


def test_fields_become_flags_the_davit_parser_reads() -> None:
    args = _args(**FP8_BOTH)
    assert args[args.index("--quantization") + 1] == "fp8"
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    parsed = build_parser().parse_args(args)
    assert (parsed.quantization, parsed.kv_cache_dtype) == ("fp8", "fp8")
    plain = _args()
    assert "--quantization" not in plain and "--kv-cache-dtype" not in plain


def test_vllm_gets_the_same_flags() -> None:
    args = _args(engine={"type": "vllm", "version": "0.30.0", **FP8_BOTH["engine"]})
    assert args[args.index("--quantization") :][:2] == ["--quantization", "fp8"]
    assert args[args.index("--kv-cache-dtype") :][:2] == ["--kv-cache-dtype", "fp8"]


@pytest.mark.parametrize(
    "bad",
    [
        {"quantization": "int4"},
        {"quantization": "int8"},  # an LM head value only
        {"kvCacheDtype": "fp8_e5m2"},
        {"lmHeadQuantization": "int4"},
        {"lmHeadQuantization": "fp8_e5m2"},
    ],
)
def test_bad_values_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as err:
        make_spec(engine={"type": "davit", "version": "0.1.0", **bad})
    (field,) = bad
    assert [e["loc"] for e in err.value.errors()] == [("engine", field)]


def test_extra_args_may_not_set_the_fp8_flags() -> None:
    """The CRD's extraArgs rule (CEL, checked by the API server) lists them as owned flags."""
    assert {"--quantization", "-q", "--kv-cache-dtype"} <= set(OWNED_FLAGS)
    rules = EngineSpec.model_json_schema()["x-kubernetes-validations"]
    owned = next(r["rule"] for r in rules if "extraArgs" in r["rule"])
    assert "'--kv-cache-dtype'" in owned and "'--quantization'" in owned


def test_estimate_counts_one_byte_per_fp8_element() -> None:
    shape = SHAPES.shapes["llama-3.1-8b"]
    limits = effective_limits(make_spec(**RANDOM_8B, limits={"maxModelLen": 8192}), shape)
    device = SHAPES.device_bytes("NVIDIA-H200")
    assert device is not None
    bf16 = estimate_memory(shape, limits, device, 1)
    fp8 = estimate_memory(shape, limits, device, 1, precision=Precision(1, 1))
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    projections = shape.projection_parameters
    assert bf16.weights_bytes - fp8.weights_bytes == projections - 4 * shape.projection_channels
    # Llama-3.1-8B: 6.98B projection weights of 8.03B; FP8 weights ~9.1 GB with scales.
    assert weight_bytes(shape, 2, Precision(1, 2)) == pytest.approx(9.07e9, rel=0.01)
    assert fp8.kv_cache_bytes > bf16.kv_cache_bytes  # the weights' savings go to the cache


def test_plan_capacity_doubles_with_an_fp8_cache() -> None:
    spec = {**RANDOM_8B, "limits": {"maxModelLen": 8192}}
    bf16 = make_plan("svc", "ns", make_spec(**spec), CATALOG).memory
    kv = make_plan("svc", "ns", make_spec(**spec, engine={"kvCacheDtype": "fp8"}), CATALOG).memory
    assert bf16 is not None and kv is not None
    assert bf16.token_capacity is not None and kv.token_capacity is not None
    assert kv.token_capacity == pytest.approx(2 * bf16.token_capacity, rel=0.001)


def test_preflight_fits_with_fp8_what_bf16_cannot() -> None:
    """Llama-3.1-70B on one H200: 141 GB of bf16 weights do not fit; 71 GB of FP8 ones do."""
    spec = {"model": {"source": "random://llama-3.1-70b", "revision": None},
            "limits": {"maxModelLen": 8192}}  # fmt: skip
    with pytest.raises(PlanError, match="InsufficientMemory|weights alone") as err:
        make_plan("svc", "ns", make_spec(**spec), CATALOG)
    assert err.value.reason == "InsufficientMemory"
    plan = make_plan("svc", "ns", make_spec(**spec, engine={"quantization": "fp8"}), CATALOG)
    assert plan.memory is not None and plan.memory.source == "estimate"


def test_identity_changes_only_when_set() -> None:
    plain = make_plan("svc", "ns", make_spec(), CATALOG)
    assert "quantization" not in profile_identity(plain)  # earlier hashes stay valid
    hashes = {
        identity_hash(profile_identity(make_plan("svc", "ns", make_spec(**o), CATALOG)))
        for o in ({}, {"engine": {"quantization": "fp8"}}, {"engine": {"kvCacheDtype": "fp8"}}, FP8_BOTH)
    }  # fmt: skip
    assert len(hashes) == 4


@pytest.mark.parametrize(
    ("accelerator", "field"),
    [
        ({"vendor": "nvidia", "product": "NVIDIA-A100-SXM4-80GB"}, "engine.quantization"),
        ({"vendor": "intel", "product": "Max_1550"}, "engine.quantization"),
        ({"vendor": "cpu", "product": None}, "engine.quantization"),
    ],
)
def test_accelerators_without_fp8_are_refused_naming_the_field(
    accelerator: dict[str, Any], field: str
) -> None:
    with pytest.raises(PlanError) as err:
        make_plan("svc", "ns", make_spec(**FP8_BOTH, accelerator=accelerator), CATALOG)
    assert err.value.reason == "UnsupportedByAccelerator"
    assert err.value.field == field
    assert "engine.quantization fp8 and engine.kvCacheDtype fp8" in err.value.message
    assert "lacking" in err.value.message
    with pytest.raises(PlanError) as only_kv:
        make_plan(
            "svc", "ns", make_spec(engine={"kvCacheDtype": "fp8"}, accelerator=accelerator), CATALOG
        )
    assert only_kv.value.field == "engine.kvCacheDtype"


def test_a100_refusal_names_products_with_fp8() -> None:
    with pytest.raises(PlanError, match="NVIDIA-H200") as err:
        make_plan("svc", "ns", make_spec(**FP8_BOTH, accelerator={"vendor": "nvidia",
                  "product": "NVIDIA-A100-SXM4-40GB"}), CATALOG)  # fmt: skip
    assert "accelerator.product NVIDIA-A100-SXM4-40GB" in err.value.message


@pytest.mark.parametrize(
    "accelerator",
    [{"vendor": "nvidia", "product": "NVIDIA-H200"}, {"vendor": "nvidia", "product": "NVIDIA-L4"},
     {"vendor": "nvidia", "product": None}, {"vendor": "nvidia", "product": "NVIDIA-RTX-PRO-6000"}],
)  # fmt: skip
def test_fp8_accelerators_and_unrecorded_products_pass(accelerator: dict[str, Any]) -> None:
    plan = make_plan("svc", "ns", make_spec(**FP8_BOTH, accelerator=accelerator), CATALOG)
    assert "--kv-cache-dtype" in plan.invocation.args


def _catalog_without_fp8() -> Catalog:
    engines = CATALOG.engines
    davit = engines.engines["davit"]
    releases = [
        r.model_copy(update={"capabilities": r.capabilities.model_copy(
            update={"quantization": [], "kv_cache_dtypes": []})})
        for r in davit.releases
    ]  # fmt: skip
    davit = davit.model_copy(update={"releases": releases})
    return CATALOG.model_copy(
        update={
            "engines": engines.model_copy(update={"engines": {**engines.engines, "davit": davit}})
        }
    )


def test_release_without_fp8_is_refused_naming_the_field_and_alternatives() -> None:
    with pytest.raises(PlanError) as err:
        make_plan("svc", "ns", make_spec(engine={"kvCacheDtype": "fp8"}), _catalog_without_fp8())
    assert err.value.reason == "UnsupportedByEngine"
    assert err.value.field == "engine.kvCacheDtype"
    assert "remove engine.kvCacheDtype" in err.value.message
    assert "engine.type: vllm" in err.value.message  # vLLM releases record no limit


LM_HEAD = {"engine": {"quantization": "fp8", "lmHeadQuantization": "fp8"}}


def test_lm_head_field_becomes_the_davit_flag_and_joins_the_identity() -> None:
    args = _args(**LM_HEAD)
    parsed = build_parser().parse_args(args)
    assert (parsed.quantization, parsed.lm_head_quantization) == ("fp8", "fp8")
    assert "--lm-head-quantization" not in _args(engine={"quantization": "fp8"})
    assert "--lm-head-quantization" in OWNED_FLAGS
    plan = make_plan("svc", "ns", make_spec(**LM_HEAD), CATALOG)
    assert profile_identity(plan)["lmHeadQuantization"] == "fp8"
    fp8 = make_plan("svc", "ns", make_spec(engine={"quantization": "fp8"}), CATALOG)
    assert "lmHeadQuantization" not in profile_identity(fp8)


def test_vllm_releases_refuse_the_lm_head_field() -> None:
    """No vLLM release has the flag: planning refuses the field by name before any pod, and
    names the Davit release that serves it."""
    with pytest.raises(PlanError) as err:
        _args(engine={"type": "vllm", "version": "0.30.0", **LM_HEAD["engine"]})
    assert err.value.reason == "UnsupportedByEngine"
    assert err.value.field == "engine.lmHeadQuantization"
    assert "remove engine.lmHeadQuantization" in err.value.message
    assert "davit" in err.value.message


def test_lm_head_field_is_refused_on_accelerators_without_fp8() -> None:
    a100 = {"vendor": "nvidia", "product": "NVIDIA-A100-SXM4-80GB"}
    with pytest.raises(PlanError) as err:
        make_plan("svc", "ns", make_spec(engine={"lmHeadQuantization": "fp8"}, accelerator=a100),
                  CATALOG)  # fmt: skip
    assert err.value.reason == "UnsupportedByAccelerator"
    assert err.value.field == "engine.lmHeadQuantization"


@pytest.mark.parametrize("shape_name", ["llama-3.1-8b", "qwen3-0.6b"])  # untied, tied
def test_estimate_counts_an_fp8_lm_head(shape_name: str) -> None:
    """Untied: the head's bf16 bytes become one byte per weight and a scale per row. Tied: the
    embedding keeps its bytes and the FP8 head is a copy beside it."""
    shape = SHAPES.shapes[shape_name]
    head = shape.vocab_size * shape.hidden_size
    fp8 = weight_bytes(shape, 2, Precision(1, 2))
    with_head = weight_bytes(shape, 2, Precision(1, 2, one_byte_lm_head=True))
    if shape.tie_word_embeddings:
        assert with_head - fp8 == head + 4 * shape.vocab_size
    else:
        assert fp8 - with_head == head - 4 * shape.vocab_size


INT8_HEAD = {"engine": {"lmHeadQuantization": "int8"}}
A100 = {"vendor": "nvidia", "product": "NVIDIA-A100-SXM4-80GB"}


def test_lm_head_values_are_fp8_and_int8_and_both_one_byte() -> None:
    assert get_args(LmHeadQuantization) == ("fp8", "int8")
    assert set(get_args(LmHeadQuantization)) == ONE_BYTE_LM_HEADS
    schema = EngineSpec.model_json_schema(by_alias=True)["properties"]["lmHeadQuantization"]
    assert {"enum": ["fp8", "int8"], "type": "string"} in schema["anyOf"]
    for value in ("fp8", "int8"):
        assert value in schema["description"]


@pytest.mark.parametrize(
    "accelerator",
    [
        A100,
        {"vendor": "intel", "product": "Max_1550"},
        {"vendor": "cpu", "product": None},
        {"vendor": "nvidia", "product": "NVIDIA-H200"},
    ],
)
def test_int8_lm_head_needs_no_fp8(accelerator: dict[str, Any]) -> None:
    """An int8 head is no FP8 field: planned on accelerators the catalog records without FP8,
    passed to the engine as --lm-head-quantization int8, named in the identity."""
    plan = make_plan("svc", "ns", make_spec(**INT8_HEAD, accelerator=accelerator), CATALOG)
    args = plan.invocation.args
    assert args[args.index("--lm-head-quantization") :][:2] == ["--lm-head-quantization", "int8"]
    assert args.count("--lm-head-quantization") == 1
    assert "--quantization" not in args and "--kv-cache-dtype" not in args
    assert build_parser().parse_args(args).lm_head_quantization == "int8"
    assert profile_identity(plan)["lmHeadQuantization"] == "int8"


def test_int8_lm_head_does_not_lift_the_fp8_refusals() -> None:
    """With FP8 fields beside it, an A100 still refuses those fields, and only those."""
    spec = make_spec(engine={"quantization": "fp8", "lmHeadQuantization": "int8"}, accelerator=A100)
    with pytest.raises(PlanError) as err:
        make_plan("svc", "ns", spec, CATALOG)
    assert err.value.reason == "UnsupportedByAccelerator"
    assert err.value.field == "engine.quantization"
    assert "lmHeadQuantization" not in err.value.message
    h200 = make_plan(
        "svc", "ns", make_spec(engine={"quantization": "fp8", "lmHeadQuantization": "int8"}),
        CATALOG,
    )  # fmt: skip
    args = h200.invocation.args
    assert args[args.index("--quantization") + 1] == "fp8"
    assert args[args.index("--lm-head-quantization") + 1] == "int8"


def test_lm_head_identities_hash_apart() -> None:
    hashes = {
        identity_hash(profile_identity(make_plan("svc", "ns", make_spec(**o), CATALOG)))
        for o in ({}, {"engine": {"lmHeadQuantization": "fp8"}}, INT8_HEAD)
    }
    assert len(hashes) == 3


def test_the_engine_takes_every_lm_head_value_the_api_and_catalog_name() -> None:
    """The API's values are the engine's; every value a Davit release lists reaches the engine
    as a flag its own parser reads."""
    assert set(get_args(LmHeadQuantization)) == set(LM_HEAD_QUANTIZATIONS)
    listed = [
        value
        for release in CATALOG.engines.engines["davit"].releases
        for value in release.capabilities.lm_head_quantization
    ]
    assert set(listed) == {"fp8", "int8"}
    for value in listed:
        args = _args(engine={"lmHeadQuantization": value})
        assert build_parser().parse_args(args).lm_head_quantization == value


@pytest.mark.parametrize("value", ["fp8", "int8"])
def test_precision_of_either_lm_head_is_one_byte(value: str) -> None:
    spec = make_spec(engine={"lmHeadQuantization": value})
    assert Precision.of(spec) == Precision(one_byte_lm_head=True)
    assert Precision.of(make_spec()) == Precision(one_byte_lm_head=False)


@pytest.mark.parametrize("shape_name", ["llama-3.1-8b", "qwen3-0.6b"])  # untied, tied
def test_estimate_counts_an_int8_lm_head_as_an_fp8_one(shape_name: str) -> None:
    """One byte per head weight and a float32 scale per row, against the model dtype's two
    bytes per weight: an untied head saves the difference, a tied one adds its copy."""
    shape = SHAPES.shapes[shape_name]
    head = shape.vocab_size * shape.hidden_size
    plain = weight_bytes(shape, 2, Precision.of(make_spec()))
    int8 = weight_bytes(shape, 2, Precision.of(make_spec(**INT8_HEAD)))
    fp8 = weight_bytes(shape, 2, Precision.of(make_spec(engine={"lmHeadQuantization": "fp8"})))
    assert int8 == fp8
    if shape.tie_word_embeddings:
        assert int8 - plain == head + 4 * shape.vocab_size
    else:
        assert plain - int8 == head - 4 * shape.vocab_size


def test_plan_estimate_counts_an_int8_lm_head_on_an_a100() -> None:
    """Llama-3.1-8B (untied, 128256 x 4096 head) on an A100: the int8 head's estimate is the
    FP8 head's on an H200 in weights, about 0.5 GB below the bf16 head's, and the KV cache gets
    the difference."""
    spec = {**RANDOM_8B, "limits": {"maxModelLen": 8192}, "accelerator": A100}
    bf16 = make_plan("svc", "ns", make_spec(**spec), CATALOG).memory
    int8 = make_plan("svc", "ns", make_spec(**spec, **INT8_HEAD), CATALOG).memory
    h200 = {**spec, "accelerator": {"vendor": "nvidia", "product": "NVIDIA-H200"}}
    fp8 = make_plan("svc", "ns", make_spec(**h200, engine={"lmHeadQuantization": "fp8"}),
                    CATALOG).memory  # fmt: skip
    assert bf16 is not None and int8 is not None and fp8 is not None
    assert bf16.source == int8.source == "estimate"
    assert bf16.weights_bytes is not None and int8.weights_bytes is not None
    shape = SHAPES.shapes["llama-3.1-8b"]
    saved = shape.vocab_size * shape.hidden_size - 4 * shape.vocab_size
    assert bf16.weights_bytes - int8.weights_bytes == saved
    assert saved == pytest.approx(0.525e9, rel=0.01)
    assert int8.weights_bytes == fp8.weights_bytes
    assert bf16.kv_cache_bytes is not None and int8.kv_cache_bytes is not None
    assert int8.kv_cache_bytes > bf16.kv_cache_bytes


def _shapes_with_fp8_checkpoint() -> Any:
    """The packaged shapes plus `llama-3.1-8b-fp8`: Llama-3.1-8B's shape marked as an FP8
    checkpoint (`fp8Projections`, as a config.json with quant_method fp8 makes it)."""
    fp8 = SHAPES.shapes["llama-3.1-8b"].model_copy(
        update={"fp8_projections": True, "names": ["example/llama-3.1-8b-fp8"]}
    )
    return SHAPES.model_copy(update={"shapes": {**SHAPES.shapes, "llama-3.1-8b-fp8": fp8}})


FP8_CHECKPOINT = {"model": {"source": "random://llama-3.1-8b-fp8", "revision": None}}


def test_fp8_checkpoint_on_an_accelerator_without_fp8_is_refused_for_davit() -> None:
    """An FP8 checkpoint served by the Davit engine without any FP8 field: planning refuses it
    on an A100, naming model.source and the products that have FP8, before any pod (the engine
    would refuse it at startup); an unquantized checkpoint there and the FP8 one on an H200
    plan."""
    shapes = _shapes_with_fp8_checkpoint()
    with pytest.raises(PlanError) as err:
        make_plan(
            "svc", "ns", make_spec(**FP8_CHECKPOINT, accelerator=A100), CATALOG, shapes=shapes
        )
    assert err.value.reason == "UnsupportedByAccelerator"
    assert err.value.field == "model.source"
    assert err.value.value == "random://llama-3.1-8b-fp8"
    assert "FP8 checkpoint" in err.value.message and "NVIDIA-H200" in err.value.message
    assert "unquantized checkpoint" in err.value.message
    make_plan("svc", "ns", make_spec(**RANDOM_8B, accelerator=A100), CATALOG, shapes=shapes)
    h200 = {"vendor": "nvidia", "product": "NVIDIA-H200"}
    plan = make_plan("svc", "ns", make_spec(**FP8_CHECKPOINT, accelerator=h200), CATALOG,
                     shapes=shapes)  # fmt: skip
    assert plan.memory is not None
    # an FP8 field as well: refused by that field, as before
    with pytest.raises(PlanError) as by_field:
        make_plan("svc", "ns", make_spec(**FP8_CHECKPOINT, **FP8_BOTH, accelerator=A100), CATALOG,
                  shapes=shapes)  # fmt: skip
    assert by_field.value.field == "engine.quantization"


def test_fp8_checkpoint_is_left_to_vllm() -> None:
    """vLLM releases decide for themselves (not checked against a release here): planned."""
    plan = make_plan(
        "svc", "ns",
        make_spec(
            model={"source": "random://example/llama-3.1-8b-fp8", "revision": None},
            accelerator=A100,
            engine={"type": "vllm", "version": "0.30.0"},
        ),
        CATALOG, shapes=_shapes_with_fp8_checkpoint(),
    )  # fmt: skip
    assert "--quantization" not in plan.invocation.args
