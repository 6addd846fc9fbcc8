"""Memory planning without a cluster: pre-flight fit check, identity, plans, the profiling Job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from davit_contract.profile import MemoryProfile
from davit_operator.builders.deployment import engine_deployment
from davit_operator.builders.metadata import Owner
from davit_operator.builders.profile_job import (
    PROFILE_IDENTITY_LABEL,
    profile_config_map,
    profile_job,
    profile_name,
)
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.errors import PlanError
from davit_operator.planning.memory import (
    KV_FLAG,
    ModelShape,
    effective_limits,
    estimate_memory,
    identity_hash,
    load_shape_catalog,
    profile_identity,
    profile_plan,
    shape_for,
    with_memory,
)
from davit_operator.planning.plan import Plan, make_plan
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
SHAPES = load_shape_catalog()
PROFILES = Path(__file__).resolve().parents[2] / "data" / "profiles"
OWNER = Owner(name="svc", uid="uid-1")


def plan_of(**overrides: Any) -> Plan:
    return make_plan("svc", "ns", make_spec(**overrides), CATALOG)


def test_shape_parameter_counts_match_the_published_sizes() -> None:
    # Published totals: 0.6B (0.44B without embeddings), 8.0B, 70.6B.
    assert SHAPES.shapes["qwen3-0.6b"].num_parameters == pytest.approx(0.596e9, rel=0.01)
    assert SHAPES.shapes["llama-3.1-8b"].num_parameters == pytest.approx(8.03e9, rel=0.01)
    assert SHAPES.shapes["llama-3.1-70b"].num_parameters == pytest.approx(70.55e9, rel=0.01)


def test_shapes_are_found_by_name_repository_or_spec() -> None:
    assert shape_for(make_spec(model={"source": "random://qwen3-0.6b"}), SHAPES) is not None
    spec = make_spec(model={"source": "hf://meta-llama/llama-3.1-8b-instruct", "revision": "x"})
    assert shape_for(spec, SHAPES) == SHAPES.shapes["llama-3.1-8b"]
    assert shape_for(make_spec(model={"source": "pvc://claim/dir"}), SHAPES) is None
    explicit = {
        "numLayers": 2,
        "hiddenSize": 64,
        "intermediateSize": 128,
        "numHeads": 4,
        "numKvHeads": 2,
        "headDim": 16,
        "vocabSize": 512,
        "maxPositionEmbeddings": 1024,
    }
    spec = make_spec(model={"source": "pvc://claim/dir", "shape": explicit})
    shape = shape_for(spec, SHAPES)
    assert isinstance(shape, ModelShape) and shape.num_layers == 2


def test_llama_70b_bf16_on_one_80gb_gpu_is_refused_with_numbers() -> None:
    with pytest.raises(PlanError) as err:
        plan_of(
            model={"source": "hf://meta-llama/Llama-3.1-70B-Instruct", "revision": "main"},
            accelerator={"vendor": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"},
        )
    e = err.value
    assert e.reason == "InsufficientMemory" and e.field == "parallelism.tensor"
    assert "weights 131.4 GiB" in e.message and "71.7 GiB per GPU" in e.message
    assert "no maxModelLen fits" in e.message and "parallelism.tensor 4 would fit" in e.message
    # The Davit engine 0.1.0 runs up to 8 GPUs per replica: the advice is the size that fits.
    assert e.message.endswith("; parallelism.tensor 4 would fit")
    with pytest.raises(PlanError) as err:
        plan_of(
            model={"source": "hf://meta-llama/Llama-3.1-70B-Instruct", "revision": "main"},
            accelerator={"vendor": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"},
            engine={"type": "vllm", "version": "0.33.0"},
        )
    assert err.value.message.endswith("; parallelism.tensor 4 would fit")
    fitting = plan_of(
        model={"source": "hf://meta-llama/Llama-3.1-70B-Instruct", "revision": "main"},
        accelerator={"vendor": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"},
        engine={"type": "vllm", "version": "0.33.0"},
        parallelism={"tensor": 4},
        limits={"maxModelLen": 8192},
    )
    assert fitting.memory is not None and fitting.memory.source == "estimate"


def test_a_shorter_max_model_len_is_offered_and_fits() -> None:
    overrides: dict[str, Any] = {
        "model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "revision": "main"},
        "accelerator": {"vendor": "nvidia", "product": "NVIDIA-L4"},
    }
    with pytest.raises(PlanError) as err:
        plan_of(**overrides)
    assert err.value.field == "limits.maxModelLen"
    largest = int(err.value.message.rsplit(" ", 1)[-1])
    assert 1024 < largest < 131072 and largest % 16 == 0
    fitting = plan_of(**overrides, limits={"maxModelLen": largest})
    assert fitting.memory is not None and fitting.memory.source == "estimate"
    with pytest.raises(PlanError):
        plan_of(**overrides, limits={"maxModelLen": largest + 16})


def test_tensor_parallelism_splits_weights_and_kv() -> None:
    shape = SHAPES.shapes["llama-3.1-70b"]
    limits = effective_limits(make_spec(), shape)
    one = estimate_memory(shape, limits, 80 << 30, 1)
    four = estimate_memory(shape, limits, 80 << 30, 4)
    assert four.weights_bytes == one.weights_bytes // 4
    assert four.kv_bytes_per_token == one.kv_bytes_per_token // 4
    assert not one.fits and four.fits


def test_unknown_shape_or_memory_skips_the_check() -> None:
    plan = plan_of(model={"source": "pvc://claim/dir"})
    assert plan.memory is None
    plan = plan_of(accelerator={"vendor": "cpu", "product": None})
    assert plan.memory is None


def test_identity_changes_with_what_the_numbers_depend_on() -> None:
    base = {"model": {"source": "random://qwen3-0.6b"}}
    reference = identity_hash(profile_identity(plan_of(**base)))
    assert identity_hash(profile_identity(plan_of(**base))) == reference
    # The name of the InferenceService is not part of it.
    other = make_plan("other", "ns", make_spec(**base), CATALOG)
    assert identity_hash(profile_identity(other)) == reference
    changes: list[dict[str, Any]] = [
        {"engine": {"image": "registry.example/davit@sha256:" + "1" * 64}},
        {"model": {"source": "random://llama-3.1-8b"}},
        {"accelerator": {"vendor": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"}},
        {"limits": {"maxModelLen": 4096}},
        {"limits": {"maxNumSeqs": 64}},
        {"limits": {"gpuMemoryUtilization": 0.8}},
        {"engine": {"extraArgs": ["--dtype=float16"]}},
    ]
    seen = {reference}
    for change in changes:
        h = identity_hash(profile_identity(plan_of(**{**base, **change})))
        assert h not in seen, change
        seen.add(h)
    revised = make_spec(model={"source": "hf://Qwen/Qwen3-0.6B", "revision": "a"})
    # Tensor parallelism (not in the Davit engine 0.1.0): on vLLM.
    vllm = {
        "model": {"source": "hf://Qwen/Qwen3-0.6B"},
        "engine": {"type": "vllm", "version": "0.33.0"},
    }
    one = identity_hash(profile_identity(plan_of(**vllm)))
    two = identity_hash(profile_identity(plan_of(**vllm, parallelism={"tensor": 2})))
    assert len({one, two} | seen) == len(seen) + 2
    revised_b = make_spec(model={"source": "hf://Qwen/Qwen3-0.6B", "revision": "b"})
    a = identity_hash(profile_identity(make_plan("s", "ns", revised, CATALOG)))
    b = identity_hash(profile_identity(make_plan("s", "ns", revised_b, CATALOG)))
    assert a != b


def test_explicit_kv_bytes_reach_the_engine() -> None:
    plan = plan_of(model={"source": "random://qwen3-0.6b"}, limits={"kvCacheMemoryBytes": 1 << 30})
    assert plan.memory is not None and plan.memory.source == "explicit"
    args = plan.invocation.args
    assert args[args.index(KV_FLAG) + 1] == str(1 << 30)


def test_profiled_plan_passes_the_measured_bytes() -> None:
    profile = MemoryProfile.from_json((PROFILES / "cpu-qwen3-0.6b.json").read_text())
    plan = plan_of(model={"source": "random://qwen3-0.6b"})
    h = identity_hash(profile_identity(plan))
    profiled = with_memory(plan, profile_plan(profile, h, profile_name(h)))
    args = profiled.invocation.args
    assert args.count(KV_FLAG) == 1
    assert args[args.index(KV_FLAG) + 1] == str(profile.memory.kv_cache_bytes)
    assert profiled.memory is not None
    status = profiled.memory.to_status()
    assert status.source == "profile"
    assert status.token_capacity == profile.memory.token_capacity
    container = engine_deployment(profiled, OWNER, "stable", 1).manifest["spec"]["template"][
        "spec"
    ]["containers"][0]
    assert container["args"] == args
    # Applying a second profile replaces the flag instead of repeating it.
    again = with_memory(profiled, profile_plan(profile, h, profile_name(h)))
    assert again.invocation.args.count(KV_FLAG) == 1


def test_profile_job_runs_the_replicas_image_and_placement() -> None:
    plan = plan_of(model={"source": "random://qwen3-0.6b"}, limits={"maxModelLen": 8192})
    h = identity_hash(profile_identity(plan))
    job = profile_job(plan, OWNER, h)
    pod = job["spec"]["template"]["spec"]
    replica = engine_deployment(plan, OWNER, "stable", 1).manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (engine,) = replica["containers"]
    assert job["metadata"]["name"] == profile_name(h)
    assert job["metadata"]["labels"][PROFILE_IDENTITY_LABEL] == h
    assert container["image"] == engine["image"] and container["command"] == engine["command"]
    assert container["args"] == [*engine["args"], "--profile-only"]
    assert container["resources"] == engine["resources"]
    assert pod["nodeSelector"] == replica["nodeSelector"]
    assert pod["tolerations"] == replica["tolerations"]
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    assert container["terminationMessagePath"] == "/dev/termination-log"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DAVIT_IMAGE_DIGEST"] == (plan.image.digest or plan.image.reference)
    # An explicit size in the replicas' arguments never reaches the profiling run.
    explicit = plan_of(model={"source": "random://qwen3-0.6b"}, limits={"kvCacheMemoryBytes": 9})
    assert (
        KV_FLAG
        not in profile_job(explicit, OWNER, h)["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    stored = profile_config_map("ns", h, "{}", "{}")
    assert stored["metadata"]["labels"][PROFILE_IDENTITY_LABEL] == h
    assert "ownerReferences" not in stored["metadata"]


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 100, 128, 256, 300, 1024])
def test_graph_logits_buffer_follows_the_engine(max_num_seqs: int) -> None:
    import torch

    from davit_contract.graphs import graph_batch_sizes, graph_logits_bytes
    from davit_engine.runner.v2.graphs import DecodeGraphs

    shape = SHAPES.shapes["qwen3-0.6b"]
    graphs = DecodeGraphs(
        lambda n, out: None,
        graph_batch_sizes(max_num_seqs),
        shape.vocab_size,
        torch.device("meta"),  # sizes only, no memory
    )
    assert graph_logits_bytes(max_num_seqs, shape.vocab_size) == graphs.logits.numel() * 4


def _graph_estimate(shape: ModelShape, max_num_seqs: int) -> int:
    from davit_contract.graphs import cuda_graph_estimate

    return cuda_graph_estimate(
        max_num_seqs, shape.vocab_size, shape.hidden_size, shape.intermediate_size, 2
    )


def test_graph_estimate_holds_no_logits_per_graph() -> None:
    """The allowance grows with the largest batch, not with the number of captured sizes: 256
    sequences (27 graphs) cost twice 128 (20 graphs)."""
    from davit_contract.graphs import graph_logits_bytes

    shape = SHAPES.shapes["qwen3-0.6b"]
    assert _graph_estimate(shape, 256) == 2 * _graph_estimate(shape, 128)
    shared = graph_logits_bytes(256, shape.vocab_size)
    # the shared float32 buffer, then the largest graph's bf16 logits and activations
    assert shared < _graph_estimate(shape, 256) < 2 * shared
    assert _graph_estimate(shape, 256) < 0.25 * 2**30


def test_graph_estimate_against_the_h200_measurements() -> None:
    """Rows of the memory check with shared graph logits: the pool plus the shared buffer."""
    rows = [json.loads(line) for line in (PROFILES / "h200-memory-check.jsonl").open()]
    shared = [r for r in rows if r.get("graph_logits") == "shared" and "measured" in r]
    assert shared, "h200-memory-check.jsonl holds no run with shared graph logits"
    for row in shared:
        shape = SHAPES.shapes[row["shape"]]
        measured = row["measured"]["cuda_graph_bytes"] + row["graph_logits_buffer_bytes"]
        estimate = _graph_estimate(shape, row["max_num_seqs"])
        assert abs(estimate - measured) / measured < 0.25, row["shape"]


def test_profile_cache_keeps_a_revisions_kv_bytes() -> None:
    from davit_operator.profiling import ProfileCache

    profile = MemoryProfile.from_json((PROFILES / "h200-qwen3-0.6b.json").read_text())
    cache = ProfileCache()
    plan = plan_of(model={"source": "random://qwen3-0.6b"}, limits={"maxModelLen": 8192})
    assert cache.apply(plan) == plan  # nothing known yet: unchanged
    cache.remember(identity_hash(profile_identity(plan)), profile)
    applied = cache.apply(plan)
    args = applied.invocation.args
    assert args[args.index(KV_FLAG) + 1] == str(profile.memory.kv_cache_bytes)
    assert applied.memory is not None and applied.memory.source == "profile"
    # Another identity is not given this profile.
    other = plan_of(model={"source": "random://qwen3-0.6b"}, limits={"maxModelLen": 4096})
    assert cache.apply(other) == other
