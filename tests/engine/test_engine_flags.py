"""Upstream flags the operator emits: each works or stops `davit serve` at startup naming it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.engine_core import EngineCore
from davit_engine.engine_flags import parse_speculative_config
from davit_engine.loader import load_model
from davit_engine.loader.hf_cache import repo_id_of, resolve_snapshot
from davit_engine.runner.sampler import unregister_logits_processor
from davit_engine.runner.select import select_runner
from davit_engine.server.cli import parse_args
from davit_engine.types import EngineRequest, ParamError, SamplingParams

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_defaults_and_size_one_work() -> None:
    config, _, _ = parse_args(
        [
            "random:qwen3-tiny",
            "--tensor-parallel-size",
            "1",
            "--pipeline-parallel-size",
            "1",
            "--data-parallel-size",
            "1",
            "--compilation-config",
            "{}",
            "--revision",
            "v1.0",
        ]
    )
    assert config.async_scheduling and config.revision == "v1.0"
    assert config.model == "random:qwen3-tiny"  # a random shape: the revision is informational
    no_async, _, _ = parse_args(["random:qwen3-tiny", "--no-async-scheduling"])
    assert not no_async.async_scheduling
    assert config.tensor_parallel_size == 1


def test_tensor_parallel_size_reaches_the_engine_config() -> None:
    """Whether a size divides the model's heads is checked when the model is known
    (tests/engine/test_tensor_parallel.py); the parser passes it on."""
    config, _, _ = parse_args(["random:qwen3-tiny", "--tensor-parallel-size", "2"])
    assert config.tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["--pipeline-parallel-size", "4"], "--pipeline-parallel-size", "--tensor-parallel-size"),
        (["--data-parallel-size", "2"], "--data-parallel-size", "scale out with replicas"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size", "between 1 and 8"),
        (["--tensor-parallel-size", "9"], "--tensor-parallel-size", "one host"),
        (["--enable-expert-parallel"], "--enable-expert-parallel", "expert parallelism"),
        (["--enable-elastic-ep"], "--enable-elastic-ep", "elastic expert"),
        (["--enable-dbo"], "--enable-dbo", "dual-batch overlap"),
        (
            ["--compilation-config", '{"pass_config": {"enable_sequence_parallelism": true}}'],
            "--compilation-config",
            "enable_sequence_parallelism",
        ),
        (["--compilation-config", '{"level": 3}'], "--compilation-config", "level"),
        (["--compilation-config", "[1]"], "--compilation-config", "JSON object"),
        (
            ["--speculative-config", '{"method":"eagle","num_speculative_tokens":4}'],
            "--speculative-config",
            "method eagle is not implemented",
        ),
        (
            [
                "--speculative-config",
                '{"method":"ngram","num_speculative_tokens":2,"rejection_sample_method":"block"}',
            ],
            "--speculative-config",
            "rejection_sample_method block is not implemented",
        ),
        (["--speculative-config", "{not json"], "--speculative-config", "JSON object"),
    ],
)
def test_unsupported_flags_are_refused_by_name(
    argv: list[str], flag: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(["random:qwen3-tiny", *argv], capsys)
    assert f"argument {flag}:" in err and words in err


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"method": "lookahead", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs model"),
        ('{"method": "draft_model", "num_speculative_tokens": 3, "model": 7}', "model must"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}', "model does not"),
        ('{"method": "eagle", "num_speculative_tokens": 3, "prompt_lookup_max": 4}', "only"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}',
            "prompt_lookup_min",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, '
            '"prompt_lookup_min": 5}',
            "exceeds",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 3, "k": 1}', "unknown key(s) k"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "x"}',
            "rejection_sample_method must",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 1, "rejection_sample_method": "fly"}',
            "needs num_speculative_tokens >= 2",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "rejection_sample_method": "fly", "fly_window_size": 4}',
            "fly_window_size must",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "fly_window_size": 2}',
            "fly_window_size only",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "rejection_sample_method": "fly", "fly_entropy_threshold": -1}',
            "fly_entropy_threshold",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "rejection_sample_method": "fly", "fly_entropy_top_k": 1}',
            "fly_entropy_top_k",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}',
            "exactly one of",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5]}',
            "synthetic_acceptance_rates must",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": 0.5}',
            "synthetic_acceptance_rates must",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4}',
            "synthetic_acceptance_length must",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2}',
            "synthetic_acceptance_length only",
        ),
        ('{"method": "mtp", "num_speculative_tokens": 2}', "method mtp is not implemented"),
    ],
)
def test_speculative_config_is_validated(text: str, words: str) -> None:
    with pytest.raises(ParamError) as err:
        parse_speculative_config(text)
    assert err.value.param == "--speculative-config" and words in err.value.message


def test_speculative_config_parses_every_field_the_operator_writes() -> None:
    text = json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": 5,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    )
    config = parse_speculative_config(text)
    assert (config.method, config.num_speculative_tokens) == ("ngram", 5)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 4)
    assert config.verification == "strict" and not config.is_lossy


def test_speculative_config_fills_upstream_defaults_and_marks_lossy_policies() -> None:
    fly = parse_speculative_config(
        '{"method": "draft_model", "model": "random:llama-3.2-1b", "num_speculative_tokens": 4,'
        ' "rejection_sample_method": "fly"}'
    )
    assert fly.fly_window_size == 3  # min(6, K - 1)
    assert (fly.fly_entropy_threshold, fly.fly_entropy_top_k) == (0.3, 3)
    assert fly.is_lossy and fly.verification == "fly" and "LOSSY" in fly.describe()
    synthetic = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": '
        '"synthetic", "synthetic_acceptance_length": 2.5}'
    )
    assert synthetic.is_lossy and "LOSSY" in synthetic.describe()
    ngram = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (3, 5)


def test_the_speculative_config_reaches_the_engine_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config, _, _ = parse_args(
        [
            "random:qwen3-tiny",
            "--speculative-config",
            '{"method":"ngram","num_speculative_tokens":4}',
        ]
    )
    assert config.speculative_config is not None
    assert config.speculative_config.num_speculative_tokens == 4


def _cache_with(snapshot_source: Path, root: Path, repo: str = "acme/tiny") -> Path:
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    shutil.copytree(snapshot_source, repo_dir / "snapshots" / COMMIT)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT + "\n")
    return repo_dir / "snapshots" / COMMIT


def test_hf_sources_load_from_the_local_cache(
    qwen3_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _cache_with(qwen3_tiny_dir, tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # no local acme/tiny directory: the bare form names the repo
    for source in ("hf://acme/tiny", "acme/tiny"):
        config, _, _ = parse_args([source])
        assert Path(config.model) == snapshot and config.served_model_name == "acme/tiny"
    by_commit, _, _ = parse_args(["hf://acme/tiny", "--revision", COMMIT])
    assert Path(by_commit.model) == snapshot and by_commit.revision == COMMIT
    # the real loader reads the resolved snapshot
    loaded = load_model(EngineConfig(model=by_commit.model, dtype="float32"), torch.device("cpu"))
    assert (
        loaded.config.architecture
        == load_model(
            EngineConfig(model=str(qwen3_tiny_dir), dtype="float32"), torch.device("cpu")
        ).config.architecture
    )


def test_uncached_models_and_revisions_say_what_to_do(
    qwen3_tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _cache_with(qwen3_tiny_dir, tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    err = refused(["hf://acme/absent"], capsys)
    assert "argument model:" in err and "acme/absent is not in the Hugging Face cache" in err
    assert "does not download" in err and "huggingface-cli download acme/absent" in err
    err = refused(["hf://acme/tiny", "--revision", "v2"], capsys)
    assert "argument --revision:" in err and "not at revision 'v2'" in err
    with pytest.raises(ParamError, match="expected hf://ORG/NAME"):
        repo_id_of("hf://just-a-name")
    assert repo_id_of("random:qwen3-tiny") is None and repo_id_of(str(qwen3_tiny_dir)) is None
    with pytest.raises(ParamError, match="no config.json"):
        broken = tmp_path / "models--acme--broken"
        (broken / "refs").mkdir(parents=True)
        (broken / "refs" / "main").write_text(COMMIT)
        resolve_snapshot("acme/broken", None, tmp_path)


PROCESSOR_MODULE = '''
import torch


class ForceSeven:
    """Makes token 7 the only choice."""

    def __call__(self, token_ids, logits):
        logits.fill_(float("-inf"))
        logits[7] = 0.0
        return logits
'''


def test_logits_processors_flag_registers_and_applies_to_every_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "davit_test_procs.py").write_text(PROCESSOR_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "davit_test_procs.ForceSeven"
    config, _, _ = parse_args(["random:qwen3-tiny", "--logits-processors", name])
    assert config.logits_processors == (name,)
    config = EngineConfig(
        model="random:qwen3-tiny",
        dtype="float32",
        num_gpu_blocks=32,
        logits_processors=config.logits_processors,
    )
    try:
        core = EngineCore(config)
        assert core.model_info.runner == "v1"
        # auto picks V1 on a GPU too, and an explicit V2 is refused naming the feature
        kind, reason = select_runner(config, torch.device("cuda"))
        assert kind == "v1" and "custom logits processors" in reason
        with pytest.raises(ParamError, match="does not support custom logits processors"):
            select_runner(EngineConfig(model="x", runner="v2"), torch.device("cuda"))
        core.add_request(EngineRequest("p", [1, 2, 3], SamplingParams(max_tokens=4)))
        tokens: list[int] = []
        while core.has_unfinished_requests():
            for delta in core.step():
                tokens.extend(delta.new_token_ids)
        assert tokens == [7, 7, 7, 7]
        core.shutdown()
    finally:
        unregister_logits_processor(name)
        sys.modules.pop("davit_test_procs", None)


@pytest.mark.parametrize(
    ("names", "words"),
    [
        (("davit_no_such_module.Proc",), "cannot import davit_no_such_module"),
        (("json.NoSuchThing",), "json has no attribute NoSuchThing"),
        (("json.__doc__",), "not callable"),
        (("plain",), "expected package.module.Class"),
    ],
)
def test_bad_logits_processors_are_named(names: tuple[str, ...], words: str) -> None:
    with pytest.raises(ParamError) as err:
        EngineCore(EngineConfig(model="random:qwen3-tiny", logits_processors=names))
    assert err.value.param == "--logits-processors" and words in err.value.message
