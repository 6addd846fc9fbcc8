"""The serving container's environment: the API key comes from a Secret by reference only."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from davit_operator.builders.deployment import engine_deployment
from davit_operator.builders.metadata import Owner
from davit_operator.builders.pod import API_KEY_ENV, serving_env
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.plan import make_plan
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="0b9c5c3e-1111-2222-3333-444455556666")
REF = {"name": "engine-keys", "key": "api-key"}


def test_without_a_secret_ref_there_is_no_api_key_variable() -> None:
    plan = make_plan("svc", "ns", make_spec(), CATALOG)
    assert all(entry["name"] != API_KEY_ENV for entry in serving_env(plan))


@pytest.mark.parametrize("engine", [{"type": "davit"}, {"type": "vllm", "version": "0.33.0"}])
def test_the_api_key_is_a_secret_reference_and_never_a_value(engine: dict[str, str]) -> None:
    literal = "leaked-literal-value"
    spec = make_spec(
        engine={**engine, "apiKeySecretRef": REF},
        pod={"env": [{"name": API_KEY_ENV, "value": literal}]},
    )
    plan = make_plan("svc", "ns", spec, CATALOG)
    manifest = engine_deployment(plan, OWNER, "stable", 1).manifest
    [container] = manifest["spec"]["template"]["spec"]["containers"]
    keys = [entry for entry in container["env"] if entry["name"] == API_KEY_ENV]
    # The typed field wins over a literal of the same name in pod.env.
    assert keys == [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": REF}}]
    rendered = json.dumps(manifest)
    assert literal not in rendered
    assert "--api-key" not in rendered
    assert not any("api" in arg.lower() and "key" in arg.lower() for arg in container["args"])


@pytest.mark.parametrize(
    "ref",
    [{"name": "", "key": "k"}, {"name": "Bad_Name", "key": "k"}, {"name": "s", "key": "a/b"},
     {"name": "s"}],
)  # fmt: skip
def test_a_malformed_secret_ref_is_refused(ref: dict[str, str]) -> None:
    with pytest.raises(ValidationError) as err:
        make_spec(engine={"apiKeySecretRef": ref})
    assert "apiKeySecretRef" in str(err.value) or "api_key_secret_ref" in str(err.value)
