"""`davit bench throughput` end to end on a tiny random model, and its argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from davit_engine.bench.cli import bench_main


def test_throughput_runs_and_reports_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = [
        "throughput",
        "--model",
        "random:qwen3-tiny",
        "--dtype",
        "float32",
        "--num-prompts",
        "6",
    ]
    argv += ["--input-len", "20", "--output-len", "5", "--output-json", str(out)]
    assert bench_main(argv) == 0
    printed = capsys.readouterr().out
    assert "runner v1" in printed and "output tokens/s" in printed and "float32" in printed
    result = json.loads(out.read_text())
    assert result["results"]["output_tokens"] == 6 * 5  # EOS ignored by default
    assert result["configuration"]["versions"]["torch"]
    assert result["results"]["output_tokens_per_s"] > 0


def test_length_range(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    argv = [
        "throughput",
        "--model",
        "random:qwen3-tiny",
        "--dtype",
        "float32",
        "--num-prompts",
        "8",
    ]
    argv += ["--input-len", "20", "--output-len", "10", "--random-range-ratio", "0.5"]
    assert bench_main([*argv, "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())["results"]
    # Lengths drawn from [10, 30] and [5, 15]: not all equal to the nominal ones.
    assert 8 * 10 <= result["prompt_tokens"] <= 8 * 30 and result["prompt_tokens"] != 8 * 20
    assert 8 * 5 <= result["output_tokens"] <= 8 * 15


def test_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["throughput", "--model", "random:qwen3-tiny", "--num-prompts", "0"]) == 2
    assert "--num-prompts" in capsys.readouterr().err
    assert bench_main(["throughput", "--model", "random:nope"]) == 2
    assert "unknown model shape" in capsys.readouterr().err
    assert (
        bench_main(["throughput", "--model", "random:qwen3-tiny", "--random-range-ratio", "1.5"])
        == 2
    )
    assert "--random-range-ratio" in capsys.readouterr().err
    assert bench_main(["frobnicate"]) == 2
