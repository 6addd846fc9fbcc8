"""The profile document: round trip, identity hash, and refusal of malformed documents."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from davit_contract.profile import (
    SCHEMA_VERSION,
    MemoryProfile,
    ProfileFormatError,
)

PROFILES = Path(__file__).resolve().parents[1] / "data" / "profiles"


def committed() -> list[Path]:
    found = sorted(PROFILES.glob("*.json"))
    assert found, f"no committed profiles under {PROFILES}"
    return found


@pytest.mark.parametrize("path", committed(), ids=lambda p: p.name)
def test_committed_profiles_parse_and_add_up(path: Path) -> None:
    profile = MemoryProfile.from_json(path.read_text())
    m = profile.memory
    assert profile.schema_version == SCHEMA_VERSION
    assert m.num_blocks == m.kv_cache_bytes // m.block_bytes
    assert m.token_capacity == m.num_blocks * profile.identity.block_size
    if m.kv_source == "profile" and m.method == "cuda":
        # On a GPU nothing caps the KV cache: the components and it fill the budget.
        used = (
            m.weights_bytes
            + m.activation_peak_bytes
            + m.cuda_graph_bytes
            + m.runner_buffer_bytes
            + m.non_torch_bytes
        )
        assert used + m.kv_cache_bytes == m.budget_bytes
        assert m.cuda_graph_bytes > 0 and m.cuda_graph_sizes
    # A termination message keeps 4096 bytes.
    assert len(profile.to_json().encode()) < 4096
    assert MemoryProfile.from_json(profile.to_json()) == profile


def _sample() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(committed()[0].read_text())
    return data


def test_identity_hash_covers_every_field() -> None:
    profile = MemoryProfile.from_json(json.dumps(_sample()))
    identity = profile.identity
    seen = {identity.hash()}
    for field in dataclasses.fields(identity):
        value = getattr(identity, field.name)
        if isinstance(value, bool):
            changed: Any = not value
        elif isinstance(value, int | float):
            changed = value + 1
        else:
            changed = value + "x"
        other = dataclasses.replace(identity, **{field.name: changed})
        assert other.hash() not in seen, field.name
        seen.add(other.hash())


def test_documents_without_the_dtype_fields_keep_their_hash() -> None:
    """The KV-cache dtype and quantization joined the identity within schema version 1:
    profiles written before (every committed one) read as "auto"/"none" with the hash they
    were stored under, and a default identity still writes that hash."""
    for path in committed():
        data = json.loads(path.read_text())
        assert "kv_cache_dtype" not in data["identity"] and "quantization" not in data["identity"]
        profile = MemoryProfile.from_json(path.read_text())
        assert profile.identity.kv_cache_dtype == "auto"
        assert profile.identity.quantization == "none"
        assert profile.identity.hash() == data["identityHash"]
        assert profile.to_dict()["identityHash"] == data["identityHash"]


def test_fp8_identities_hash_apart_and_round_trip() -> None:
    profile = MemoryProfile.from_json(json.dumps(_sample()))
    kv = dataclasses.replace(profile.identity, kv_cache_dtype="fp8")
    weights = dataclasses.replace(profile.identity, quantization="fp8")
    both = dataclasses.replace(kv, quantization="fp8")
    head = dataclasses.replace(both, lm_head_quantization="fp8")
    native = dataclasses.replace(weights, fp8_block_scales="native")
    hashes = {i.hash() for i in (profile.identity, kv, weights, both, head, native)}
    assert len(hashes) == 6
    for identity in (both, head, native):
        again = MemoryProfile.from_json(dataclasses.replace(profile, identity=identity).to_json())
        assert again.identity == identity and again.identity.hash() == identity.hash()


def test_lm_head_values_hash_apart_and_round_trip() -> None:
    """The engine writes the --lm-head-quantization value it loaded with: "fp8" and "int8"
    identities differ from each other and from the model dtype's head ("none", left out of the
    hash), and both survive the JSON round trip."""
    profile = MemoryProfile.from_json(json.dumps(_sample()))
    assert profile.identity.lm_head_quantization == "none"
    heads = {
        value: dataclasses.replace(profile.identity, lm_head_quantization=value)
        for value in ("none", "fp8", "int8")
    }
    assert heads["none"].hash() == profile.identity.hash()
    assert len({identity.hash() for identity in heads.values()}) == 3
    for value in ("fp8", "int8"):
        document = dataclasses.replace(profile, identity=heads[value]).to_dict()
        assert document["identity"]["lm_head_quantization"] == value
        again = MemoryProfile.from_dict(json.loads(json.dumps(document)))
        assert again.identity == heads[value] and again.identity.hash() == heads[value].hash()


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda d: d.update(kind="Other"), "kind must be"),
        (lambda d: d.update(schemaVersion=99), "schemaVersion 99"),
        (lambda d: d["identity"].pop("gpu_product"), "identity lacks gpu_product"),
        (lambda d: d["memory"].update(num_blocks="7"), "memory.num_blocks must be an integer"),
        (lambda d: d["memory"].update(method=3), "memory.method must be a string"),
        (lambda d: d.update(identityHash="0" * 16), "does not match"),
        (lambda d: d.update(memory=[]), "memory must be an object"),
    ],
)
def test_malformed_documents_are_refused(mutate: Any, error: str) -> None:
    data = _sample()
    mutate(data)
    with pytest.raises(ProfileFormatError, match=error):
        MemoryProfile.from_json(json.dumps(data))


def test_not_json_is_refused() -> None:
    with pytest.raises(ProfileFormatError, match="not JSON"):
        MemoryProfile.from_json("{oops")
    with pytest.raises(ProfileFormatError, match="JSON object"):
        MemoryProfile.from_json("[]")


def test_the_contract_needs_no_torch() -> None:
    code = (
        "import sys; import davit_contract.profile, davit_contract.graphs, "
        "davit_contract.engine_defaults; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_offload_section_round_trips_and_is_checked() -> None:
    base = MemoryProfile.from_dict(_sample())
    with_tiers = dataclasses.replace(base, offload={"cpu_bytes": 1 << 30, "cpu_blocks": 512})
    text = with_tiers.to_json()
    assert MemoryProfile.from_json(text).offload == {"cpu_bytes": 1 << 30, "cpu_blocks": 512}
    assert "offload" not in base.to_dict()  # absent unless the engine has tiers
    for bad in ([], {"cpu_bytes": "1"}, {"cpu_bytes": True}):
        data = with_tiers.to_dict()
        data["offload"] = bad
        with pytest.raises(ProfileFormatError, match="offload"):
            MemoryProfile.from_dict(data)
