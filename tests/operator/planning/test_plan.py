"""Planning: image resolution, runner selection, engine arguments, placement and fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.loader import Catalog, load_catalog
from davit_operator.planning.errors import PlanError
from davit_operator.planning.placement import NodeFacts
from davit_operator.planning.plan import Plan, make_plan
from tests.operator.isvc_helpers import example_documents, make_spec

CATALOG = load_catalog()
H200 = {"nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.present": "true"}
NODES = [
    NodeFacts("gpu-h200-0", H200, {"cpu": "223500m", "memory": "2095104Mi", "nvidia.com/gpu": "8"}),
    NodeFacts("cpu-0", {}, {"cpu": "63500m", "memory": "260096Mi"}),
]


VLLM_031 = {"type": "vllm", "version": "0.31.0"}
VLLM_033 = {"type": "vllm", "version": "0.33.0"}


def plan(spec: InferenceServiceSpec, catalog: Catalog = CATALOG) -> Plan:
    return make_plan("svc", "ns", spec, catalog, NODES)


def refusal(spec: InferenceServiceSpec, catalog: Catalog = CATALOG) -> PlanError:
    with pytest.raises(PlanError) as err:
        plan(spec, catalog)
    return err.value


def test_nothing_special_selects_v2() -> None:
    p = plan(make_spec())
    assert p.runner.name == "v2"
    assert p.runner.reason == "V2 is the default runner of davit 0.1.0"
    assert p.image.reference == "ghcr.io/davit-dev/davit-engine:0.1.0-cuda13.0"
    assert p.image.variant == "cuda13.0" and not p.image.pinned
    assert p.invocation.args[-2:] == ["--runner", "v2"]


def test_custom_logits_processor_on_davit_falls_back_to_v1() -> None:
    p = plan(make_spec(features={"customLogitsProcessors": ["my.pkg:Bias"]}))
    assert p.runner.name == "v1" and p.runner.deprecated
    assert p.runner.reason == (
        "features.customLogitsProcessors (custom logits processors) is not supported by runner "
        "V2 of davit 0.1.0; falling back to V1 (deprecated)"
    )
    args = p.invocation.args
    assert args[args.index("--logits-processors") + 1] == "my.pkg:Bias"
    assert args[-2:] == ["--runner", "v1"]


def test_custom_logits_processor_on_vllm_033_runs_on_v2() -> None:
    """vLLM 0.31.0 and later build custom logits processors in runner V2 (evidence: they left
    the release's V2-unsupported list)."""
    p = plan(
        make_spec(
            engine={"type": "vllm", "version": "0.33.0"},
            features={"customLogitsProcessors": ["my.pkg:Bias"]},
        )
    )
    assert p.runner.name == "v2" and not p.runner.is_fallback
    args = p.invocation.args
    assert args[args.index("--logits-processors") + 1] == "my.pkg:Bias"


def test_custom_logits_processor_on_vllm_030_goes_to_v1_by_itself() -> None:
    p = plan(
        make_spec(
            engine={"type": "vllm", "version": "0.30.0"},
            features={"customLogitsProcessors": ["my.pkg:Bias"]},
        )
    )
    assert p.runner.name == "v1" and p.runner.is_fallback
    assert p.runner.reason == (
        "features.customLogitsProcessors (custom logits processors) is not supported by runner "
        "V2 of vllm 0.30.0; the release falls back to V1 by itself (deprecated)"
    )
    # The release decides by itself: the operator sets no runner variable with engine.runner auto.
    assert all(e["name"] != "VLLM_USE_V2_MODEL_RUNNER" for e in p.invocation.env)
    assert "--runner" not in p.invocation.args


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("parallelism", {"tensor": 2, "sequenceParallelism": True}),
        ("parallelism", {"dualBatchOverlap": True, "expert": {"enabled": True}}),
        ("parallelism", {"expert": {"enabled": True, "elastic": True}}),
    ],
)
def test_v1_only_parallel_features(field: str, value: dict[str, object]) -> None:
    p = plan(make_spec(**{field: value, "engine": VLLM_031, "accelerator": {"vendor": "nvidia"}}))
    assert p.runner.name == "v1" and "not supported by runner V2" in p.runner.reason


def test_cuda129_on_vllm_033_names_the_last_release() -> None:
    err = refusal(make_spec(engine={"type": "vllm", "version": "0.33.0", "variant": "cuda12.9"}))
    assert (err.field, err.value, err.reason) == (
        "engine.variant",
        "cuda12.9",
        "VariantNotPublished",
    )
    assert "last published in 0.32.0" in err.message
    assert "use engine.variant cuda13.0 or pin engine.version <= 0.32.0" in err.message


def test_cuda129_on_vllm_032_is_published_but_not_recorded() -> None:
    err = refusal(make_spec(engine={"type": "vllm", "version": "0.32.0", "variant": "cuda12.9"}))
    assert err.reason == "ImageNotRecorded" and "set engine.image" in err.message
    ok = plan(
        make_spec(
            engine={
                "type": "vllm",
                "version": "0.32.0",
                "variant": "cuda12.9",
                "image": "registry.example/vllm:v0.32.0-cu129",
            }
        )
    )
    assert ok.image.source == "override" and ok.image.tag == "v0.32.0-cu129"
    assert ok.image.repository == "registry.example/vllm"


def test_unknown_version_lists_known_ones() -> None:
    err = refusal(make_spec(engine={"type": "vllm", "version": "0.33.1"}))
    assert err.field == "engine.version" and err.reason == "UnknownVersion"
    assert "0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0, 0.34.0" in err.message


def test_vllm_033_records_exact_tag_and_title() -> None:
    p = plan(make_spec(engine={"type": "vllm", "version": "0.33.0"}))
    assert p.image.reference == "vllm/vllm-openai:v0.33.0rc3"
    assert p.image.release_title == "v0.33.0" and p.image.engine_version == "0.33.0"
    assert p.invocation.command == ["vllm", "serve"]
    assert p.health.readiness == "/health"
    # A release with a single runner needs no switch.
    assert all(e["name"] != "VLLM_USE_V2_MODEL_RUNNER" for e in p.invocation.env)


def test_vllm_028_defaults_to_v2_for_dense_models() -> None:
    """The 0.28.0 wheel picks V2 unless the model is outside its default-V2 set, which only the
    release can tell: status says so."""
    p = plan(make_spec(engine={"type": "vllm", "version": "0.28.0"}))
    assert p.runner.name == "v2"
    assert p.runner.reason == (
        "V2 is the default runner of vllm 0.28.0; vllm 0.28.0 may still pick V1 by itself for "
        "models outside its default-V2 set (MoE architectures it does not list, hybrid, "
        "attention-free and pooling models)"
    )


def test_strict_policy_refuses_unpinned_images() -> None:
    err = refusal(make_spec(engine={"imagePolicy": "Strict"}))
    assert err.field == "engine.imagePolicy" and err.reason == "UnpinnedImage"
    assert "ghcr.io/davit-dev/davit-engine@sha256:DIGEST" in err.message
    digest = "a" * 64
    p = plan(
        make_spec(
            engine={
                "imagePolicy": "Strict",
                "image": f"ghcr.io/davit-dev/davit-engine@sha256:{digest}",
            }
        )
    )
    assert p.image.pinned and p.image.digest == f"sha256:{digest}"
    assert p.image.reference.endswith(f"@sha256:{digest}")


def test_forced_runners() -> None:
    err = refusal(make_spec(engine={"type": "vllm", "version": "0.34.0", "runner": "v1"}))
    assert (err.field, err.value, err.reason) == ("engine.runner", "v1", "RunnerUnavailable")
    assert err.message == (
        "engine.runner v1: vllm 0.34.0 no longer ships runner V1; V1 was last shipped in 0.33.0: "
        "pin engine.version <= 0.33.0, or set engine.runner: auto"
    )
    forced = plan(make_spec(engine={"type": "vllm", "version": "0.33.0", "runner": "v1"}))
    assert forced.runner.reason == "engine.runner is v1 (VLLM_USE_V2_MODEL_RUNNER=0)"
    assert {"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "0"} in forced.invocation.env
    err = refusal(
        make_spec(engine={"runner": "v2"}, features={"customLogitsProcessors": ["a.b:C"]})
    )
    assert err.reason == "RunnerUnsupported" and err.field == "features.customLogitsProcessors"
    assert "set engine.runner: auto" in err.message
    forced = plan(make_spec(engine={"runner": "v1"}))
    assert forced.runner.name == "v1" and forced.runner.reason == "engine.runner is v1"


def test_davit_on_cpu_and_rocm_uses_v1() -> None:
    p = plan(make_spec(accelerator={"vendor": "cpu", "product": None}))
    assert p.runner.name == "v1"
    assert p.runner.reason.startswith(
        "the cpu variant (runner V2 runs on NVIDIA GPUs only) is not supported by runner V2"
    )
    assert p.image.tag == "0.1.0-cpu"
    p = plan(make_spec(accelerator={"vendor": "amd", "product": None}))
    assert p.image.variant == "rocm" and p.runner.name == "v1"


MEDUSA = {"speculative": {"method": "medusa", "draftModel": "org/medusa-heads"}}


def test_speculative_method_the_release_lacks_is_refused() -> None:
    err = refusal(make_spec(engine=VLLM_033, features={"speculative": {"method": "medusa"}}))
    assert err.reason == "UnsupportedByEngine" and err.field == "features.speculative.method"
    assert "or serve it with engine.version 0.28.0 to 0.32.0" in err.message
    p = plan(make_spec(engine={**VLLM_033, "version": "0.32.0"}, features=MEDUSA))
    assert p.runner.name == "v1" and "(speculative method 'medusa')" in p.runner.reason


def test_ngram_speculative_arguments() -> None:
    p = plan(
        make_spec(
            engine=VLLM_033,
            features={
                "speculative": {
                    "method": "ngram",
                    "numSpeculativeTokens": 3,
                    "promptLookupMax": 5,
                    "promptLookupMin": 2,
                }
            },
        )
    )
    args = p.invocation.args
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 2,
    }
    assert p.runner.name == "v2"


def test_engine_arguments_follow_the_spec() -> None:
    p = plan(
        make_spec(
            model={"servedName": "chat"},
            engine={**VLLM_033, "extraArgs": ["--enforce-eager"]},
            parallelism={"tensor": 4, "pipeline": 2},
            limits={
                "maxModelLen": 8192,
                "maxNumSeqs": 64,
                "maxNumBatchedTokens": 4096,
                "gpuMemoryUtilization": 0.85,
            },
            features={"prefixCaching": False},
            pod={"env": [{"name": "HF_HOME", "value": "/data/hf"}, {"name": "X", "value": "1"}]},
        )
    )
    args = p.invocation.args
    assert args[0] == "Qwen/Qwen3-8B"
    pairs = dict(zip(args[1::2], args[2::2], strict=False))
    assert args[args.index("--served-model-name") + 1] == "chat"
    assert args[args.index("--revision") + 1] == "main"
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert args[args.index("--max-model-len") + 1] == "8192"
    assert args[args.index("--max-num-seqs") + 1] == "64"
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.85"
    assert "--no-enable-prefix-caching" in args and pairs
    assert args[-1] == "--enforce-eager"
    assert p.invocation.env == [
        {"name": "HF_HOME", "value": "/data/hf"},
        {"name": "X", "value": "1"},
    ]
    assert p.placement.accelerator_count == 8
    assert p.placement.resources["limits"] == {"nvidia.com/gpu": "8"}


def test_pvc_gguf_and_random_sources() -> None:
    p = plan(
        make_spec(model={"source": "pvc://models/smollm2", "revision": None, "file": "q4.gguf"})
    )
    assert p.invocation.args[0] == "/models/models/smollm2/q4.gguf"
    assert p.served_name == "q4"
    mount = p.invocation.model_mounts[0]
    assert (mount.claim_name, mount.mount_path) == ("models", "/models/models")
    p = plan(make_spec(model={"source": "random://qwen3-0.6b", "revision": None}))
    assert p.invocation.args[0] == "random:qwen3-0.6b"
    assert "--load-format" not in p.invocation.args
    vllm = {"type": "vllm", "version": "0.33.0"}
    p = plan(make_spec(model={"source": "random://Qwen/Qwen3-0.6B", "revision": None}, engine=vllm))
    args = p.invocation.args
    assert args[0] == "Qwen/Qwen3-0.6B" and args[args.index("--load-format") + 1] == "dummy"
    err = refusal(make_spec(model={"source": "random://qwen3-0.6b", "revision": None}, engine=vllm))
    assert err.field == "model.source" and "use random://ORG/NAME" in err.message


def test_placement_per_vendor() -> None:
    nvidia = plan(make_spec()).placement
    assert nvidia.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert nvidia.resources == {
        "requests": {"cpu": "4", "memory": "32Gi"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    amd = make_plan(
        "a", "ns", make_spec(accelerator={"vendor": "amd", "product": "X"}), CATALOG
    ).placement
    assert amd.node_selector == {"amd.com/gpu.product-name": "X"}
    assert amd.resources["limits"] == {"amd.com/gpu": "1"}
    intel = make_plan(
        "i", "ns", make_spec(accelerator={"vendor": "intel", "product": "Max_1550"}), CATALOG
    ).placement
    assert intel.resources["limits"] == {"gpu.intel.com/i915": "1"}
    assert intel.node_selector == {"gpu.intel.com/product": "Max_1550"}
    cpu = plan(
        make_spec(
            accelerator={"vendor": "cpu", "product": None},
            pod={"resources": {"requests": {"cpu": 2}, "limits": {"memory": "8Gi"}}},
        )
    ).placement
    assert cpu.resources == {
        "requests": {"cpu": "2", "memory": "16Gi"},
        "limits": {"memory": "8Gi"},
    }
    assert cpu.affinity is not None and cpu.node_selector == {} and cpu.summary == "cpu"


def test_more_gpus_than_any_node_is_explained() -> None:
    p = plan(make_spec(engine=VLLM_033, parallelism={"tensor": 16}))
    assert p.fit.fits is False
    assert "needs 16 nvidia.com/gpu" in p.fit.message
    assert "largest matching node offers 8 (gpu-h200-0)" in p.fit.message


def test_unknown_product_is_explained() -> None:
    p = plan(make_spec(accelerator={"product": "NVIDIA-B300"}))
    assert p.fit.fits is False
    assert "nvidia.com/gpu.product=NVIDIA-B300" in p.fit.message
    assert "nodes offer nvidia.com/gpu.product=NVIDIA-H200" in p.fit.message


def test_fit_unknown_without_nodes() -> None:
    p = make_plan("svc", "ns", make_spec(), CATALOG, None)
    assert p.fit.fits is None
    assert plan(make_spec()).fit.fits is True


def test_rocm_model_rules_are_named_not_guessed() -> None:
    """vLLM 0.29.0 to 0.31.0 pick V1 by themselves on ROCm for architectures they list; the
    operator cannot see the architecture, so status names the rule instead of guessing."""
    rocm = {"accelerator": {"vendor": "amd", "product": None}}
    for version in ("0.29.0", "0.30.0", "0.31.0"):
        p = plan(make_spec(engine={"type": "vllm", "version": version}, **rocm))
        assert p.runner.name == "v2"
        assert p.runner.reason.endswith(
            f"vllm {version} may still pick V1 by itself for the architectures it lists in "
            "ROCM_DEFAULT_MRV1_ARCHITECTURES"
        )
        cuda = plan(make_spec(engine={"type": "vllm", "version": version}))
        assert cuda.runner.reason == f"V2 is the default runner of vllm {version}"
    p = plan(make_spec(engine=VLLM_033, **rocm))
    assert p.runner.reason == "V2 is the default runner of vllm 0.33.0"


EXPECTED = {
    "cpu-smollm2.yaml": ("ghcr.io/davit-dev/davit-engine:0.1.0-cpu", "v1"),
    "ngram-speculative.yaml": ("vllm/vllm-openai:v0.33.0rc3", "v2"),
    "qwen3-h200-davit.yaml": ("ghcr.io/davit-dev/davit-engine:0.1.0-cuda13.0", "v2"),
    "rocm-mi300x.yaml": ("vllm/vllm-openai-rocm:v0.33.0rc3", "v2"),
    "vllm-0.33-h200.yaml": ("vllm/vllm-openai:v0.33.0rc3", "v2"),
    "xpu-max1550.yaml": ("ghcr.io/davit-dev/davit-engine:0.1.0-xpu", "v1"),
}


def test_every_example_plans() -> None:
    documents = example_documents()
    assert set(documents) == set(EXPECTED)
    for name, doc in documents.items():
        assert doc["apiVersion"] == "serving.davit.dev/v1alpha1", name
        spec = InferenceServiceSpec.model_validate(doc["spec"])
        p = make_plan(doc["metadata"]["name"], "ns", spec, CATALOG)
        assert (p.image.reference, p.runner.name) == EXPECTED[name], name


def test_catalog_digest_pins_the_image(tmp_path: Path) -> None:
    source = Path(load_catalog.__code__.co_filename).parent
    data = yaml.safe_load((source / "engines.yaml").read_text())
    digest = "sha256:" + "b" * 64
    data["engines"]["vllm"]["releases"][-2]["images"]["cuda13.0"]["digest"] = digest
    (tmp_path / "engines.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "accelerators.yaml").write_text((source / "accelerators.yaml").read_text())
    catalog = load_catalog(tmp_path)
    p = plan(
        make_spec(engine={"type": "vllm", "version": "0.33.0", "imagePolicy": "Strict"}), catalog
    )
    assert p.image.reference == f"vllm/vllm-openai:v0.33.0rc3@{digest}"
    assert p.image.pinned and p.image.tag == "v0.33.0rc3" and p.image.digest == digest


def test_taints_must_be_tolerated() -> None:
    tainted = [
        NodeFacts(
            "gpu-h200-0",
            H200,
            {"cpu": "200", "memory": "2000Gi", "nvidia.com/gpu": "8"},
            taints=({"key": "dedicated", "value": "training", "effect": "NoSchedule"},),
        )
    ]
    p = make_plan("svc", "ns", make_spec(), CATALOG, tainted)
    assert p.fit.fits is False
    assert "dedicated=training:NoSchedule" in p.fit.message and "pod.tolerations" in p.fit.message
    tolerated = make_spec(
        pod={"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "training"}]}
    )
    assert make_plan("svc", "ns", tolerated, CATALOG, tainted).fit.fits is True
    # The vendor's own toleration covers the GPU operator's usual taint.
    gpu_taint = [
        NodeFacts(
            "gpu-h200-1",
            H200,
            {"cpu": "200", "memory": "2000Gi", "nvidia.com/gpu": "8"},
            taints=({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},),
        )
    ]
    assert make_plan("svc", "ns", make_spec(), CATALOG, gpu_taint).fit.fits is True
