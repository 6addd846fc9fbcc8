"""NOTES.txt: the commands it prints after install work against the real operator and engine
code (the cluster tests also apply its example and wait for it to become Ready)."""

from __future__ import annotations

import re

import pytest
import yaml

from .test_chart_cluster import notes_example
from .tools import CHART, Helm


def rendered_notes(helm: Helm, *set_args: str) -> str:
    result = helm.run(
        "install",
        "davit",
        str(CHART),
        "--dry-run=client",
        "--namespace=davit-system",
        *(f"--set={s}" for s in set_args),
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("\nNOTES:\n", 1)
    assert len(notes) == 2, result.stdout
    return notes[1]


@pytest.mark.parametrize(
    ("set_args", "namespace"), [([], "default"), (["watchNamespace=team-a"], "team-a")]
)
def test_notes_example_plans_and_is_served_where_the_commands_say(
    helm: Helm, set_args: list[str], namespace: str
) -> None:
    from davit_engine.shapes import SHAPES
    from davit_operator.api.spec import InferenceServiceSpec
    from davit_operator.catalog.loader import default_catalog
    from davit_operator.planning.plan import make_plan

    notes = rendered_notes(helm, *set_args)
    example = yaml.safe_load(notes_example(notes))
    name = example["metadata"]["name"]
    spec = InferenceServiceSpec.model_validate(example["spec"])
    plan = make_plan(name, namespace, spec, default_catalog())
    assert plan.image.variant == "cpu"

    # A random:// source names one of the engine's built-in shapes.
    source = example["spec"]["model"]["source"]
    if source.startswith("random://"):
        assert source.removeprefix("random://") in SHAPES

    # Every command runs in the namespace the operator watches.
    namespaces = set(re.findall(r"--namespace (\S+)", notes)) - {"davit-system"}
    assert namespaces == {namespace}
    # port-forward reaches the Service the operator creates (named after the object, on its port),
    # and the request names the model the engine serves.
    assert f"service/{name} {plan.port}:{plan.port}" in notes
    assert f"http://127.0.0.1:{plan.port}/v1/chat/completions" in notes
    assert f'"model": "{plan.served_name}"' in notes
    assert "kubectl get infsvc" in notes
