"""features.kvCacheOffloading: validation, engine flags (parsed by the engine's own parser),
the disk tier's volume, the pod's memory, the tiers' token capacities and refusals of tiers an
engine release lacks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from davit_contract.profile import MemoryProfile
from davit_engine.server.cli import parse_args
from davit_operator.api.crdgen import build_crd
from davit_operator.builders.deployment import engine_deployment
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.errors import PlanError
from davit_operator.planning.memory import profile_plan, with_memory
from davit_operator.planning.offload import OFFLOAD_DIR
from davit_operator.planning.plan import Plan, make_plan
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="0b9c5c3e-1111-2222-3333-444455556666")
GIB = 2**30
PROFILES = Path(__file__).resolve().parents[2] / "data" / "profiles"


def offloading(**tiers: Any) -> dict[str, Any]:
    return {"features": {"kvCacheOffloading": tiers}}


def plan_of(**overrides: Any) -> Plan:
    return make_plan("svc", "ns", make_spec(**overrides), CATALOG)


def pod_of(plan: Plan) -> dict[str, Any]:
    manifest = engine_deployment(plan, OWNER, "stable", plan.replicas).manifest
    pod: dict[str, Any] = manifest["spec"]["template"]["spec"]
    return pod


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_davit_gets_both_tiers_and_parses_them() -> None:
    plan = plan_of(
        model={"source": "random://qwen3-0.6b", "revision": None},
        **offloading(cpu={"size": "32Gi"}, disk={"size": "100Gi"}),
    )
    args = plan.invocation.args
    assert flag(args, "--kv-offloading-size") == "32.0"
    assert flag(args, "--kv-offload-disk-path") == OFFLOAD_DIR
    assert int(flag(args, "--kv-offload-disk-bytes")) == int(100 * GIB * 0.9)
    config, _, _ = parse_args(args)  # the engine's own parser and validation
    assert config.kv_offloading_size == 32.0
    assert config.kv_offload_disk_path == OFFLOAD_DIR
    assert config.kv_offload_disk_bytes == int(100 * GIB * 0.9)


def test_the_disk_tier_is_an_empty_dir_or_the_named_claim() -> None:
    pod = pod_of(plan_of(**offloading(disk={"size": "50Gi"})))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kv-offload"] == {"name": "kv-offload", "emptyDir": {"sizeLimit": "50Gi"}}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["kv-offload"] == {"name": "kv-offload", "mountPath": OFFLOAD_DIR}
    claim = {"size": "50Gi", "kind": "PersistentVolumeClaim", "claimName": "kv-cache"}
    pod = pod_of(plan_of(**offloading(disk=claim)))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kv-offload"]["persistentVolumeClaim"] == {"claimName": "kv-cache"}
    assert "kv-offload" not in {v["name"] for v in pod_of(plan_of())["volumes"]}


def test_the_pod_memory_grows_by_the_cpu_tier() -> None:
    base = pod_of(plan_of())["containers"][0]["resources"]
    grown = pod_of(plan_of(**offloading(cpu={"size": "16Gi"})))["containers"][0]["resources"]
    assert int(grown["requests"]["memory"]) == 32 * GIB + 16 * GIB  # one GPU's default + tier
    assert base["requests"]["memory"] == "32Gi"
    limited = plan_of(
        pod={"resources": {"requests": {"memory": "40Gi"}, "limits": {"memory": "48Gi"}}},
        **offloading(cpu={"size": "8Gi"}),
    )
    resources = pod_of(limited)["containers"][0]["resources"]
    assert int(resources["requests"]["memory"]) == 48 * GIB
    assert int(resources["limits"]["memory"]) == 56 * GIB


def test_memory_plan_reports_each_tier_in_tokens() -> None:
    plan = plan_of(
        limits={"kvCacheMemoryBytes": 8 * GIB},
        **offloading(cpu={"size": "16Gi"}, disk={"size": "100Gi"}),
    )
    memory = plan.memory
    assert memory is not None and memory.kv_cache_bytes == 8 * GIB and memory.token_capacity
    block_bytes = memory.kv_cache_bytes // (memory.token_capacity // 16)
    assert memory.cpu_offload_tokens == 16 * GIB // block_bytes * 16
    assert memory.disk_offload_tokens == int(100 * GIB * 0.9) // (block_bytes + 64) * 16
    status = memory.to_status().model_dump(by_alias=True, exclude_none=True)
    assert status["cpuOffloadTokenCapacity"] == memory.cpu_offload_tokens
    assert status["diskOffloadTokenCapacity"] == memory.disk_offload_tokens
    without = plan_of(limits={"kvCacheMemoryBytes": 8 * GIB}).memory
    assert without is not None
    assert "cpuOffloadTokenCapacity" not in without.to_status().model_dump(
        by_alias=True, exclude_none=True
    )


def test_a_profile_with_tiers_reports_what_the_engine_measured() -> None:
    plan = plan_of(**offloading(cpu={"size": "16Gi"}))
    profile = MemoryProfile.from_json((PROFILES / "h200-qwen3-0.6b.json").read_text())
    tiers = {"cpu_token_capacity": 1234, "disk_token_capacity": 0}
    measured = profile_plan(
        MemoryProfile(profile.identity, profile.memory, offload=tiers), "abc", "davit-profile-abc"
    )
    memory = with_memory(plan, measured).memory
    assert memory is not None
    assert memory.cpu_offload_tokens == 1234 and memory.disk_offload_tokens is None


def test_vllm_gets_its_cpu_tier_flags() -> None:
    plan = plan_of(engine={"type": "vllm", "version": "0.33.0"}, **offloading(cpu={"size": "24Gi"}))
    args = plan.invocation.args
    assert flag(args, "--kv-offloading-size") == "24.0"
    assert flag(args, "--kv-offloading-backend") == "native"
    assert "--kv-offload-disk-path" not in args


def test_vllm_has_no_bounded_disk_tier_and_is_refused_naming_the_field() -> None:
    with pytest.raises(PlanError) as err:
        plan_of(engine={"type": "vllm", "version": "0.33.0"}, **offloading(disk={"size": "10Gi"}))
    assert err.value.field == "features.kvCacheOffloading.disk"
    assert err.value.reason == "UnsupportedByEngine"
    assert "vllm 0.33.0 has no disk tier" in err.value.message


@pytest.mark.parametrize(
    ("features", "words"),
    [
        ({"kvCacheOffloading": {}}, "needs cpu, disk or both"),
        ({"kvCacheOffloading": {"cpu": {"size": "0"}}}, "cpu.size must be positive"),
        ({"kvCacheOffloading": {"cpu": {"size": -5}}}, "cpu.size must be positive"),
        ({"kvCacheOffloading": {"disk": {"size": "ten"}}}, "disk.size must be a quantity"),
        (
            {"kvCacheOffloading": {"disk": {"size": "1Gi", "kind": "PersistentVolumeClaim"}}},
            "claimName is required",
        ),
        (
            {"kvCacheOffloading": {"disk": {"size": "1Gi", "claimName": "x"}}},
            "claimName is required",
        ),
        ({"prefixCaching": False, "kvCacheOffloading": {"cpu": {"size": "1Gi"}}}, "prefixCaching"),
    ],
)
def test_bad_offload_specs_are_refused(features: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        make_spec(features=features)


def test_the_crd_carries_the_cel_rules() -> None:
    text = json.dumps(build_crd())
    for rule in (
        "has(self.cpu) || has(self.disk)",
        "self.kind != 'PersistentVolumeClaim' || has(self.claimName)",
        "quantity(self.size).isGreaterThan(quantity('0'))",
        "!has(self.kvCacheOffloading) || self.prefixCaching",
    ):
        assert rule in text, rule
