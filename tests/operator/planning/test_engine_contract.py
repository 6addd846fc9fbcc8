"""The Davit engine accepts the command lines the operator builds for it.

Parses the operator's arguments with `davit serve`'s own parser, so a flag renamed on either side
fails here instead of in a crash-looping pod.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from davit_engine.server.cli import build_parser, parse_args
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.args import engine_invocation
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import make_plan
from davit_operator.planning.runner import SelectedRunner
from tests.operator.isvc_helpers import make_spec

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


@pytest.mark.parametrize(
    ("overrides", "refused_flag"),
    [
        ({}, None),  # hf://Qwen/Qwen3-8B at revision main, from the local cache
        ({"model": {"revision": None}}, None),
        # parallelism.tensor 2: the catalog refuses it for davit 0.1.0 (maxTensorParallel 1),
        # the engine runs it (tests/engine/test_tensor_parallel.py).
        ({"parallelism": {"pipeline": 2}}, "--pipeline-parallel-size"),
        ({"parallelism": {"data": 2}}, "--data-parallel-size"),
        ({"parallelism": {"expert": {"enabled": True}}}, "--enable-expert-parallel"),
        (
            {
                "parallelism": {
                    "expert": {"enabled": True, "elastic": True},
                    "dualBatchOverlap": True,
                }
            },
            "--enable-expert-parallel",
        ),
        (
            {
                "features": {
                    "speculative": {
                        "method": "ngram",
                        "numSpeculativeTokens": 3,
                        "promptLookupMax": 4,
                        "promptLookupMin": 2,
                    }
                }
            },
            None,
        ),
        (
            {
                "features": {
                    "speculative": {
                        "method": "draft_model",
                        "draftModel": "Qwen/Qwen3-0.6B",
                        "verification": "FLy",
                        "fly": {"windowSize": 2, "entropyThreshold": 0.5},
                    }
                }
            },
            None,
        ),
        ({"features": {"speculative": {"method": "eagle"}}}, "--speculative-config"),
        ({"features": {"customLogitsProcessors": ["json.JSONDecoder"]}}, None),
        ({"engine": {"runner": "v2"}, "rollout": {"drainSeconds": 5}}, None),
    ],
)
def test_every_flag_the_operator_emits_for_davit_parses_or_is_refused_by_name(
    overrides: dict[str, object],
    refused_flag: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every argument line parses with `davit serve`'s parser; the full startup check then
    accepts it or stops naming the flag (never an unknown-argument error, never ignored)."""
    commit = "0" * 40
    for name in ("Qwen3-0.6B", "Qwen3-8B"):  # the model and a draft model in the local cache
        repo = tmp_path / f"models--Qwen--{name}"
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spec = make_spec(**overrides)
    if refused_flag is not None:
        # The operator refuses these before any pod (catalog capabilities); the flags it would
        # emit must still be ones the engine knows and refuses by name.
        with pytest.raises(PlanError) as refused:
            make_plan("svc", "ns", spec, CATALOG)
        assert refused.value.reason == "UnsupportedByEngine"
        engine = CATALOG.engines.engines["davit"]
        release = engine.release("0.1.0")
        assert release is not None
        args = engine_invocation(spec, engine, release, SelectedRunner("v2", "", False)).args
    else:
        plan = make_plan("svc", "ns", spec, CATALOG)
        args = plan.invocation.args
    build_parser().parse_args(args)  # argparse exits 2 on any flag it does not know
    if refused_flag is None:
        config, settings, _ = parse_args(args)
        assert config.model == str(repo / "snapshots" / commit)
        assert config.served_model_name == plan.served_name
        assert settings.drain_timeout_s == plan.spec.rollout.drain_seconds
        if plan.spec.features.custom_logits_processors:
            assert config.logits_processors == tuple(plan.spec.features.custom_logits_processors)
            assert config.runner == "v1"  # the operator falls back to V1 for them too
        speculative = plan.spec.features.speculative
        if speculative is not None:
            parsed = config.speculative_config
            assert parsed is not None and parsed.method == speculative.method
            assert parsed.num_speculative_tokens == speculative.num_speculative_tokens
            assert parsed.verification == ("fly" if speculative.verification == "FLy" else "strict")
            assert plan.runner.name == "v2"  # speculative decoding runs on V2 only
            if speculative.draft_model:
                assert parsed.model == str(tmp_path / "models--Qwen--Qwen3-0.6B/snapshots" / commit)
            if speculative.fly is not None:
                assert parsed.fly_window_size == speculative.fly.window_size
                assert parsed.fly_entropy_threshold == speculative.fly.entropy_threshold
        return
    assert refused_flag in args
    with pytest.raises(SystemExit) as exc:
        parse_args(args)
    assert exc.value.code == 2
    assert f"argument {refused_flag}:" in capsys.readouterr().err


def test_sequence_parallelism_has_no_davit_flag() -> None:
    """davit 0.1.0 records no sequence-parallelism setting: planning refuses the spec and the
    argument builder itself refuses to write a flag for it, naming the field."""
    spec = make_spec(parallelism={"tensor": 2, "sequenceParallelism": True})
    with pytest.raises(PlanError) as refused:
        make_plan("svc", "ns", spec, CATALOG)
    assert refused.value.reason == "UnsupportedByEngine"
    engine = CATALOG.engines.engines["davit"]
    release = engine.release("0.1.0")
    assert release is not None
    with pytest.raises(PlanError) as builder:
        engine_invocation(spec, engine, release, SelectedRunner("v2", "", False))
    assert builder.value.field == "parallelism.sequenceParallelism"
    assert "has no sequence-parallelism setting" in builder.value.message
