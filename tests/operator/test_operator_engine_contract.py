"""The Davit engine accepts the command lines the operator builds for it.

Parses the operator's arguments with `davit serve`'s own parser, so a flag renamed on either side
fails here instead of in a crash-looping pod.
"""

from __future__ import annotations

import pytest
from isvc_helpers import make_spec

from davit_engine.server.cli import build_parser
from davit_operator.catalog import load_catalog
from davit_operator.planning import make_plan

CATALOG = load_catalog()


@pytest.mark.parametrize(
    "overrides",
    [
        {"model": {"source": "pvc://models/smollm2", "revision": None, "file": "q4.gguf"}},
        {"model": {"source": "random://qwen3-0.6b", "revision": None}},
        {
            "model": {"source": "random://smollm2-135m", "revision": None, "servedName": "tiny"},
            "accelerator": {"vendor": "cpu", "product": None},
            "features": {"prefixCaching": False},
            "limits": {"maxModelLen": 2048, "maxNumSeqs": 8, "maxNumBatchedTokens": 512},
        },
        {
            "model": {"source": "pvc://weights/qwen3-8b", "revision": None},
            "engine": {"runner": "v1", "extraArgs": ["--enforce-eager"]},
            "limits": {"gpuMemoryUtilization": 0.85},
        },
    ],
)
def test_davit_serve_parses_the_operator_arguments(overrides: dict[str, object]) -> None:
    plan = make_plan("svc", "ns", make_spec(**overrides), CATALOG)
    assert plan.invocation.command == ["davit", "serve"]
    parsed = build_parser().parse_args(plan.invocation.args)
    assert parsed.host == "0.0.0.0" and parsed.port == 8000
    assert parsed.runner == plan.runner.name
    assert parsed.served_model_name == plan.served_name
    assert parsed.enable_prefix_caching == plan.spec.features.prefix_caching
    if plan.spec.limits.max_model_len is not None:
        assert parsed.max_model_len == plan.spec.limits.max_model_len
