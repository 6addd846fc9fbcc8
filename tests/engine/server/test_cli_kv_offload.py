"""`davit serve` KV offload flags: upstream's --kv-offloading-size/--kv-offloading-backend and
our disk tier flags reach EngineConfig; bad values name the flag."""

from __future__ import annotations

import pytest

from davit_engine.server.cli import parse_args


def test_offload_flags_map_onto_the_engine_config() -> None:
    config, _, _ = parse_args(
        ["m.gguf", "--kv-offloading-size", "1.5", "--kv-offloading-backend", "native"]
        + ["--kv-offload-disk-path", "/var/kv", "--kv-offload-disk-bytes", "1000000000"]
    )
    assert config.kv_offloading_size == 1.5 and config.kv_offloading_backend == "native"
    assert config.kv_offload_disk_path == "/var/kv"
    assert config.kv_offload_disk_bytes == 1_000_000_000
    assert config.has_kv_offload


def test_offload_is_off_by_default() -> None:
    config, _, _ = parse_args(["m.gguf"])
    assert not config.has_kv_offload and config.kv_offloading_size is None


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--kv-offloading-size", "0"], "--kv-offloading-size"),
        (["--kv-offloading-size", "-1"], "--kv-offloading-size"),
        (["--kv-offloading-size", "nan"], "--kv-offloading-size"),
        (["--kv-offloading-size", "inf"], "--kv-offloading-size"),
        (["--kv-offloading-size", "lots"], "--kv-offloading-size"),
        (
            ["--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"],
            "--kv-offloading-backend",
        ),
        (["--kv-offload-disk-path", "/x"], "--kv-offload-disk-bytes"),
        (["--kv-offload-disk-bytes", "100"], "--kv-offload-disk-path"),
        (
            ["--kv-offload-disk-path", "/x", "--kv-offload-disk-bytes", "0"],
            "--kv-offload-disk-bytes",
        ),
        (["--kv-offload-disk-path", "", "--kv-offload-disk-bytes", "9"], "--kv-offload-disk-path"),
        (["--kv-offloading-size", "1", "--no-enable-prefix-caching"], "--kv-offloading-size"),
    ],
)
def test_bad_offload_flags_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["m.gguf", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
