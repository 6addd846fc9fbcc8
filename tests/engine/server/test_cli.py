"""`davit serve` flags: upstream names map onto EngineConfig; bad values name the flag."""

from __future__ import annotations

import pytest

from davit_engine.server.auth import API_KEY_ENV
from davit_engine.server.cli import parse_args
from davit_engine.server.state import DEFAULT_MAX_REQUEST_BODY_BYTES


def test_flags_map_onto_the_engine_config() -> None:
    config, settings, log_level = parse_args(
        ["m.gguf", "--port", "9001", "--served-model-name", "smol", "--dtype", "float32"]
        + ["--max-model-len", "512", "--block-size", "32", "--max-num-seqs", "4"]
        + ["--max-num-batched-tokens", "256", "--max-queue-len", "0", "--no-enable-prefix-caching"]
        + ["--num-gpu-blocks-override", "64", "--kv-cache-memory-bytes", "1000000"]
        + ["--gpu-memory-utilization", "0.5", "--runner", "v1", "--enforce-eager"]
        + ["--max-logprobs", "5", "--tokenizer", "byte", "--seed", "7", "--device", "cpu"]
        + ["--drain-timeout", "2.5", "--log-level", "warning"]
    )
    assert config.model == "m.gguf" and config.model_name == "smol"
    assert (config.dtype, config.device, config.seed) == ("float32", "cpu", 7)
    assert (config.max_model_len, config.block_size, config.max_num_seqs) == (512, 32, 4)
    assert (config.max_num_batched_tokens, config.max_queue_len) == (256, 0)
    assert config.enable_prefix_caching is False
    assert (config.num_gpu_blocks, config.kv_cache_memory_bytes) == (64, 1000000)
    assert (config.gpu_memory_utilization, config.runner, config.enforce_eager) == (0.5, "v1", True)
    assert (config.max_logprobs, config.tokenizer) == (5, "byte")
    assert (settings.host, settings.port, settings.drain_timeout_s) == ("127.0.0.1", 9001, 2.5)
    assert log_level == "warning"


def test_defaults() -> None:
    config, settings, _ = parse_args(["m.gguf"])
    assert config.enable_prefix_caching is True and config.max_queue_len is None
    assert settings.drain_timeout_s == 30.0 and settings.port == 8000


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--port", "0"], "--port"),
        (["--port", "70000"], "--port"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--max-num-seqs", "many"], "--max-num-seqs"),
        (["--block-size", "12"], "--block-size"),
        (["--dtype", "float8"], "--dtype"),
        (["--max-queue-len", "-1"], "--max-queue-len"),
        (["--drain-timeout", "-3"], "--drain-timeout"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--runner", "v3"], "--runner"),
        (["--lm-head-quantization", "int4"], "--lm-head-quantization"),
        (["--fp8-block-scales", "blocks"], "--fp8-block-scales"),
        (["--no-enable-chunked-prefill", "--max-model-len", "4096"], "--max-num-batched-tokens"),
        (["--bogus-flag"], "--bogus-flag"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["m.gguf", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_fp8_flags_map_onto_the_engine_config() -> None:
    config, _, _ = parse_args(["m.gguf", "-q", "fp8", "--lm-head-quantization", "fp8"])
    assert (config.quantization, config.lm_head_quantization) == ("fp8", "fp8")
    config, _, _ = parse_args(["m.gguf", "--quantization", "fp8"])
    assert config.lm_head_quantization is None  # the head is quantized only when asked
    config, _, _ = parse_args(["m.gguf", "--lm-head-quantization", "int8"])
    assert (config.quantization, config.lm_head_quantization) == (None, "int8")
    assert config.fp8_block_scales == "channel"  # block checkpoints: converted unless asked
    config, _, _ = parse_args(["m.gguf", "--fp8-block-scales", "native"])
    assert config.fp8_block_scales == "native"


def test_missing_model_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([])
    assert exit_info.value.code == 2
    assert "model" in capsys.readouterr().err


def test_hardening_flags_map_onto_the_server_settings() -> None:
    _, settings, _ = parse_args(
        ["m.gguf", "--api-key", "k1", "--max-request-body-bytes", "4096"]
        + ["--request-read-timeout", "2.5", "--allow-special-tokens-in-content"]
    )
    assert settings.api_key == "k1" and settings.max_request_body_bytes == 4096
    assert settings.request_read_timeout_s == 2.5
    assert settings.allow_special_tokens_in_content is True
    _, defaults, _ = parse_args(["m.gguf"])
    assert defaults.max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES
    assert defaults.allow_special_tokens_in_content is False
    assert "k1" not in repr(settings)


def test_the_api_key_comes_from_the_environment_unless_the_flag_is_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse_args(["m.gguf"])[1].api_key == "from-env"
    assert parse_args(["m.gguf", "--api-key", "flag"])[1].api_key == "flag"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert parse_args(["m.gguf"])[1].api_key is None
    monkeypatch.setenv(API_KEY_ENV, "never-printed")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "never-printed" not in help_text and API_KEY_ENV in help_text
    assert "--max-request-body-bytes" in help_text and "413" in help_text
    assert "--allow-special-tokens-in-content" in help_text


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
        (["--request-read-timeout", "0"], "--request-read-timeout"),
        (["--request-read-timeout", "inf"], "--request-read-timeout"),
        (["--request-read-timeout", "nan"], "--request-read-timeout"),
    ],
)
def test_bad_hardening_flags_name_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["m.gguf", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
