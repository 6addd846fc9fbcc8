"""Planning refuses what the engine release itself does not implement (catalog `capabilities`).

The Davit engine 0.1.0 stops at startup on multi-GPU layouts, expert parallelism and speculative
decoding; planning must refuse those specs before any pod exists, name the field and point at the
catalog releases that would serve them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from davit_engine.engine_flags import (
    SPECULATIVE_METHODS,
    check_parallelism,
    check_speculative_config,
)
from davit_engine.server.cli import build_parser
from davit_engine.types import ParamError
from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.loader import Catalog, CatalogError, load_catalog
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import Plan, make_plan
from davit_operator.status.compute import compute_status
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
PACKAGED = Path(load_catalog.__code__.co_filename).parent
DAVIT_0_1 = CATALOG.engines.engines["davit"].release("0.1.0")
VLLM_ANY = "or serve it with engine.type: vllm and engine.version >= 0.28.0"
# vLLM's compilation pass config has no sequence-parallelism key from 0.32.0 on.
VLLM_SP = "or serve it with engine.type: vllm and engine.version 0.28.0 to 0.31.0"
# medusa is no speculative method of vLLM from 0.33.0 on.
VLLM_MEDUSA = "or serve it with engine.type: vllm and engine.version 0.28.0 to 0.32.0"


def plan(spec: InferenceServiceSpec, catalog: Catalog = CATALOG) -> Plan:
    return make_plan("svc", "ns", spec, catalog)


def refusal(spec: InferenceServiceSpec, catalog: Catalog = CATALOG) -> PlanError:
    with pytest.raises(PlanError) as err:
        plan(spec, catalog)
    return err.value


def catalog_with(tmp_path: Path, edit: Any) -> Catalog:
    """The packaged catalog after `edit(data)` on engines.yaml."""
    data = yaml.safe_load((PACKAGED / "engines.yaml").read_text())
    edit(data)
    (tmp_path / "engines.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "accelerators.yaml").write_text((PACKAGED / "accelerators.yaml").read_text())
    return load_catalog(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "field", "value", "says"),
    [
        (
            {"parallelism": {"tensor": 16}, "accelerator": {"count": 16}},
            "parallelism.tensor",
            16,
            [
                "davit 0.1.0 does not support parallelism.tensor 16 (at most 8)",
                "set parallelism.tensor to at most 8",
                VLLM_ANY,
            ],
        ),
        (
            {"parallelism": {"pipeline": 2}},
            "parallelism.pipeline",
            2,
            ["parallelism.pipeline 2 (at most 1)", "set parallelism.pipeline to 1", VLLM_ANY],
        ),
        (
            {"parallelism": {"data": 4}},
            "parallelism.data",
            4,
            ["parallelism.data 4 (at most 1)", "set parallelism.data to 1", VLLM_ANY],
        ),
        (
            {"parallelism": {"expert": {"enabled": True}}},
            "parallelism.expert.enabled",
            True,
            [
                "parallelism.expert.enabled (no expert parallelism)",
                "remove parallelism.expert",
                VLLM_ANY,
            ],
        ),
        (
            {"parallelism": {"expert": {"enabled": True, "elastic": True}}},
            "parallelism.expert.enabled",
            True,
            # Elastic expert parallelism: V1 on vLLM 0.28-0.31 (by itself), V2 from 0.32.
            ["parallelism.expert.elastic", "remove parallelism.expert.elastic", VLLM_ANY],
        ),
        (
            {"parallelism": {"expert": {"enabled": True}, "dualBatchOverlap": True}},
            "parallelism.expert.enabled",
            True,
            # Dual-batch overlap: V1 on vLLM 0.28-0.33 (by itself), the only runner V2 in 0.34.
            ["parallelism.dualBatchOverlap", "remove parallelism.dualBatchOverlap", VLLM_ANY],
        ),
        (
            {
                "parallelism": {"tensor": 2, "sequenceParallelism": True},
                "accelerator": {"count": 2},
            },
            "parallelism.sequenceParallelism",
            True,
            ["parallelism.sequenceParallelism", VLLM_SP],
        ),
        (
            {"features": {"speculative": {"method": "eagle", "numSpeculativeTokens": 3}}},
            "features.speculative.method",
            "eagle",
            [
                "features.speculative.method eagle (speculative methods: ngram, draft_model)",
                "use features.speculative.method ngram or draft_model or remove "
                "features.speculative",
                VLLM_ANY,
            ],
        ),
        (
            # medusa runs on runner V1 of vLLM 0.28-0.32 and is gone from 0.33.
            {"features": {"speculative": {"method": "medusa"}}},
            "features.speculative.method",
            "medusa",
            ["features.speculative.method medusa", VLLM_MEDUSA],
        ),
    ],
)
def test_davit_refuses_what_the_engine_does_not_implement(
    overrides: dict[str, Any], field: str, value: object, says: list[str]
) -> None:
    err = refusal(make_spec(**overrides))
    assert (err.field, err.value, err.reason, err.condition) == (
        field,
        value,
        "UnsupportedByEngine",
        "",
    )
    for text in says:
        assert text in err.message, (text, err.message)


def test_refusal_is_not_a_runner_choice() -> None:
    """A forced runner does not get around the engine's own limits (the engine refuses the flag
    under both runners)."""
    for runner in ("v1", "v2"):
        err = refusal(
            make_spec(
                engine={"runner": runner},
                parallelism={"tensor": 16},
                accelerator={"count": 16},
            )
        )
        assert err.reason == "UnsupportedByEngine" and err.field == "parallelism.tensor"


def test_every_shortfall_is_named_once() -> None:
    err = refusal(
        make_spec(
            parallelism={"tensor": 16, "pipeline": 2},
            accelerator={"count": 32},
            features={"speculative": {"method": "mtp"}},
        )
    )
    assert err.field == "parallelism.tensor"
    assert err.message.startswith(
        "davit 0.1.0 does not support parallelism.tensor 16 (at most 8), parallelism.pipeline 2 "
        "(at most 1), features.speculative.method mtp (speculative methods: ngram, "
        "draft_model); "
    )
    assert err.message.count("set parallelism.tensor to at most 8") == 1


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"parallelism": {"tensor": 1, "pipeline": 1, "data": 1}, "accelerator": {"count": 1}},
        {"features": {"customLogitsProcessors": ["my.pkg:Bias"]}},
        {"accelerator": {"vendor": "cpu", "product": None}, "parallelism": {"data": 1}},
        {"replicas": 4, "features": {"prefixCaching": False}},
    ],
)
def test_davit_specs_within_its_capabilities_plan(overrides: dict[str, Any]) -> None:
    p = plan(make_spec(**overrides))
    assert p.image.engine_type == "davit"
    args = p.invocation.args
    for flag in (
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--data-parallel-size",
        "--enable-expert-parallel",
        "--speculative-config",
    ):
        assert flag not in args


@pytest.mark.parametrize(
    "overrides",
    [
        {"parallelism": {"tensor": 2}},
        {"parallelism": {"tensor": 2, "pipeline": 2, "data": 2}},
        {"parallelism": {"expert": {"enabled": True}}},
        {"features": {"speculative": {"method": "ngram"}}},
    ],
)
def test_vllm_keeps_serving_them(overrides: dict[str, Any]) -> None:
    p = plan(make_spec(engine={"type": "vllm", "version": "0.33.0"}, **overrides))
    assert p.runner.name == "v2"


def test_refusal_stalls_the_inference_service() -> None:
    err = refusal(make_spec(parallelism={"tensor": 16}, accelerator={"count": 16}))
    status = compute_status(
        plan=None, error=err, deployment=None, old_status={}, generation=3, now="t"
    )
    conds = {c.type: c for c in status.conditions}
    assert conds["Stalled"].status == "True"
    assert conds["Stalled"].reason == "UnsupportedByEngine"
    assert "parallelism.tensor 16" in conds["Stalled"].message
    assert conds["Ready"].status == "False"
    assert conds["Reconciling"].status == "False"


def test_capabilities_are_catalog_data(tmp_path: Path) -> None:
    def allow_two(data: dict[str, Any]) -> None:
        data["engines"]["davit"]["releases"][0]["capabilities"]["maxTensorParallel"] = 2
        data["engines"]["davit"]["releases"][0]["capabilities"]["speculativeMethods"] = ["ngram"]

    catalog = catalog_with(tmp_path, allow_two)
    p = plan(make_spec(parallelism={"tensor": 2}), catalog)
    assert p.placement.accelerator_count == 2
    args = p.invocation.args
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    err = refusal(make_spec(parallelism={"tensor": 4}), catalog)
    assert "parallelism.tensor 4 (at most 2)" in err.message
    assert "set parallelism.tensor to at most 2" in err.message
    assert (
        plan(make_spec(features={"speculative": {"method": "ngram"}}), catalog).runner.name == "v2"
    )
    err = refusal(make_spec(features={"speculative": {"method": "eagle"}}), catalog)
    assert "(speculative methods: ngram)" in err.message
    assert "use features.speculative.method ngram or remove features.speculative" in err.message


def test_a_newer_release_of_the_same_engine_is_offered_first(tmp_path: Path) -> None:
    def add_release(data: dict[str, Any]) -> None:
        releases = data["engines"]["davit"]["releases"]
        newer = {**releases[0], "version": "0.2.0", "tag": "0.2.0", "title": "0.2.0"}
        newer["capabilities"] = {
            "maxTensorParallel": 16,
            "expertParallel": False,
            "unsupportedFeatures": ["sequenceParallelism"],
        }
        newer["images"] = {
            variant: {**entry, "tag": entry["tag"].replace("0.1.0", "0.2.0")}
            if entry.get("tag")
            else entry
            for variant, entry in releases[0]["images"].items()
        }
        releases.append(newer)

    catalog = catalog_with(tmp_path, add_release)
    err = refusal(make_spec(parallelism={"tensor": 16}, accelerator={"count": 16}), catalog)
    assert "or serve it with engine.version >= 0.2.0 or engine.type: vllm" in err.message
    # 0.2.0 still records no expert parallelism: only vLLM is offered for it.
    err = refusal(make_spec(parallelism={"expert": {"enabled": True}}), catalog)
    assert "or serve it with engine.type: vllm and engine.version >= 0.28.0" in err.message
    assert "0.2.0" not in err.message
    assert plan(
        make_spec(engine={"version": "0.2.0"}, parallelism={"tensor": 2}), catalog
    ).image.tag == ("0.2.0-cuda13.0")


def test_the_davit_release_lists_both_lm_head_values() -> None:
    assert DAVIT_0_1 is not None
    assert DAVIT_0_1.capabilities.lm_head_quantization == ["fp8", "int8"]
    for release in CATALOG.engines.engines["vllm"].releases:  # the Davit engine's own flag
        assert release.capabilities.lm_head_quantization == []


def _davit_lm_heads(values: list[str], newer: list[str] | None = None) -> Any:
    """An edit: davit 0.1.0 lists `values`; with `newer`, a davit 0.2.0 (0.1.0's facts and
    images) lists those."""

    def edit(data: dict[str, Any]) -> None:
        releases = data["engines"]["davit"]["releases"]
        releases[0]["capabilities"]["lmHeadQuantization"] = values
        if newer is not None:
            release = {**releases[0], "version": "0.2.0", "tag": "0.2.0", "title": "0.2.0"}
            release["capabilities"] = {**releases[0]["capabilities"], "lmHeadQuantization": newer}
            release["images"] = {
                variant: {**entry, "tag": entry["tag"].replace("0.1.0", "0.2.0")}
                if entry.get("tag")
                else entry
                for variant, entry in releases[0]["images"].items()
            }
            releases.append(release)

    return edit


def test_a_release_listing_only_fp8_refuses_an_int8_lm_head(tmp_path: Path) -> None:
    """A release implements an LM head value only where the catalog lists it: int8 is refused
    by field before any pod (no other release serves it here), fp8 still plans."""
    catalog = catalog_with(tmp_path, _davit_lm_heads(["fp8"]))
    a100 = {"vendor": "nvidia", "product": "NVIDIA-A100-SXM4-80GB"}
    err = refusal(make_spec(engine={"lmHeadQuantization": "int8"}, accelerator=a100), catalog)
    assert err.reason == "UnsupportedByEngine"
    assert (err.field, err.value) == ("engine.lmHeadQuantization", "int8")
    assert err.message == (
        "davit 0.1.0 does not support engine.lmHeadQuantization int8; "
        "remove engine.lmHeadQuantization"
    )
    args = plan(make_spec(engine={"lmHeadQuantization": "fp8"}), catalog).invocation.args
    assert args[args.index("--lm-head-quantization") + 1] == "fp8"


def test_an_int8_lm_head_refusal_names_the_release_that_lists_it(tmp_path: Path) -> None:
    catalog = catalog_with(tmp_path, _davit_lm_heads(["fp8"], newer=["fp8", "int8"]))
    err = refusal(make_spec(engine={"lmHeadQuantization": "int8"}), catalog)
    assert err.field == "engine.lmHeadQuantization"
    assert err.message.endswith(
        "remove engine.lmHeadQuantization, or serve it with engine.version >= 0.2.0"
    )
    args = plan(
        make_spec(engine={"version": "0.2.0", "lmHeadQuantization": "int8"}), catalog
    ).invocation.args
    assert args[args.index("--lm-head-quantization") + 1] == "int8"


def test_a_runner_rule_on_fp8_does_not_hold_for_an_int8_lm_head(tmp_path: Path) -> None:
    """The rules' `fp8` condition is FP8 (e4m3) only: an fp8 head meets it, an int8 one not."""

    def fp8_on_v1(data: dict[str, Any]) -> None:
        rule = {"text": "FP8", "effects": ["selectsV1OnAuto", "refusedOnV2"], "when": ["fp8"]}
        data["engines"]["davit"]["releases"][0]["runnerRules"].append(rule)

    catalog = catalog_with(tmp_path, fp8_on_v1)
    fp8 = plan(make_spec(engine={"lmHeadQuantization": "fp8"}), catalog)
    assert fp8.runner.name == "v1" and fp8.runner.is_fallback
    assert "engine.lmHeadQuantization fp8" in fp8.runner.reason
    int8 = plan(make_spec(engine={"lmHeadQuantization": "int8"}), catalog)
    assert int8.runner.name == "v2" and not int8.runner.is_fallback
    assert plan(make_spec(engine={"runner": "v2", "lmHeadQuantization": "int8"}), catalog)


def test_vllm_refuses_an_int8_lm_head_and_names_davit() -> None:
    err = refusal(make_spec(engine={"type": "vllm", "version": "0.30.0",
                                    "lmHeadQuantization": "int8"}))  # fmt: skip
    assert err.reason == "UnsupportedByEngine"
    assert (err.field, err.value) == ("engine.lmHeadQuantization", "int8")
    assert "vllm 0.30.0 does not support engine.lmHeadQuantization int8" in err.message
    assert "engine.type: davit and engine.version >= 0.1.0" in err.message


@pytest.mark.parametrize(
    ("capabilities", "complaint"),
    [
        ({"maxTensorParallel": 0}, "maxTensorParallel"),
        ({"lmHeadQuantization": ["int4"]}, "lmHeadQuantization"),
        ({"speculativeMethods": ["lookahead"]}, "speculativeMethods"),
        ({"unsupportedFeatures": ["warpSpeed"]}, "unsupportedFeatures"),
        ({"pipelineParallel": 2}, "pipelineParallel"),
    ],
)
def test_malformed_capabilities_stop_the_catalog(
    tmp_path: Path, capabilities: dict[str, Any], complaint: str
) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["engines"]["davit"]["releases"][0]["capabilities"] = capabilities

    with pytest.raises(CatalogError) as err:
        catalog_with(tmp_path, edit)
    assert "engines.yaml" in str(err.value) and complaint in str(err.value)


def test_the_davit_catalog_entry_matches_the_engine_refusals() -> None:
    """The catalog's davit 0.1.0 capabilities are exactly what the engine's startup checks
    accept: one size above each limit, expert parallelism and every speculative method are
    refused by the engine, and the limits themselves are accepted."""
    assert DAVIT_0_1 is not None
    caps = DAVIT_0_1.capabilities
    limits = (caps.max_tensor_parallel, caps.max_pipeline_parallel, caps.max_data_parallel)
    assert None not in limits
    check_parallelism(*limits)  # type: ignore[arg-type]
    for i, flag in enumerate(
        ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size")
    ):
        sizes = [*limits]
        sizes[i] += 1  # type: ignore[operator]
        with pytest.raises(ParamError) as err:
            check_parallelism(*sizes)  # type: ignore[arg-type]
        assert err.value.param == flag
    assert not caps.expert_parallel
    with pytest.raises(ParamError):
        check_parallelism(1, 1, 1, expert=True)
    assert caps.speculative_methods == ["ngram", "draft_model"]
    for method in SPECULATIVE_METHODS:
        config = (
            f'{{"method": "{method}", "num_speculative_tokens": 2'
            + (', "model": "Qwen/Qwen3-0.6B"' if method == "draft_model" else "")
            + "}"
        )
        if method in caps.speculative_methods:
            parsed = check_speculative_config(config)
            assert parsed is not None and parsed.method == method
            continue
        with pytest.raises(ParamError) as err:
            check_speculative_config(config)
        assert f"method {method}" in str(err.value)


def test_davit_tensor_parallelism_runs_on_runner_v1() -> None:
    """Davit 0.1.0 serves parallelism.tensor up to 8 on runner V1 (its V2 has no tensor
    parallelism): auto falls back and says why, a forced V2 is refused, and the combinations
    its V1 refuses with several ranks (KV offload tiers) are refused by field; FP8 weights, KV
    cache and LM head pass to every rank."""
    p = plan(make_spec(parallelism={"tensor": 2}, accelerator={"count": 2}))
    assert p.runner.name == "v1" and p.runner.is_fallback
    assert "tensor parallelism" in p.runner.reason
    assert p.placement.accelerator_count == 2
    args = p.invocation.args
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--runner") + 1] == "v1"
    err = refusal(
        make_spec(engine={"runner": "v2"}, parallelism={"tensor": 2}, accelerator={"count": 2})
    )
    assert err.field == "parallelism.tensor" and "tensor parallelism" in err.message
    err = refusal(
        make_spec(
            parallelism={"tensor": 2},
            accelerator={"count": 2},
            features={"kvCacheOffloading": {"cpu": {"size": "4Gi"}}},
        )
    )
    assert "features.kvCacheOffloading" in err.message
    fp8 = {"quantization": "fp8", "kvCacheDtype": "fp8", "lmHeadQuantization": "fp8"}
    p = plan(make_spec(parallelism={"tensor": 2}, accelerator={"count": 2}, engine=fp8))
    args = p.invocation.args
    assert p.runner.name == "v1"
    for flag in ("--quantization", "--kv-cache-dtype", "--lm-head-quantization"):
        assert args[args.index(flag) + 1] == "fp8"
    parsed = build_parser().parse_args(args)  # the engine's own parser takes them together
    assert parsed.tensor_parallel_size == 2 and parsed.lm_head_quantization == "fp8"
    # an int8 head needs no FP8: tensor parallelism with it on an A100 (every rank its rows)
    a100 = {"vendor": "nvidia", "product": "NVIDIA-A100-SXM4-80GB", "count": 2}
    p = plan(make_spec(parallelism={"tensor": 2}, accelerator=a100,
                       engine={"lmHeadQuantization": "int8"}))  # fmt: skip
    assert p.runner.name == "v1"
    parsed = build_parser().parse_args(p.invocation.args)
    assert parsed.tensor_parallel_size == 2 and parsed.lm_head_quantization == "int8"
