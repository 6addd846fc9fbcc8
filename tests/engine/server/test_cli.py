"""`davit serve` flags: upstream names map onto EngineConfig; bad values name the flag."""

from __future__ import annotations

import pytest

from davit_engine.server.cli import parse_args


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


def test_missing_model_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([])
    assert exit_info.value.code == 2
    assert "model" in capsys.readouterr().err
