"""`davit bench serve` against the app with the fake core: real HTTP, real streaming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from davit_engine.bench.serve import percentile, serve_bench_main

from .conftest import serve_fake


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0


@pytest.mark.parametrize("load", [["--concurrency", "4"], ["--request-rate", "200"]])
def test_bench_serve_reports_every_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], load: list[str]
) -> None:
    out = tmp_path / "bench.json"
    with serve_fake(step_s=0.002, max_num_seqs=8) as server:
        code = serve_bench_main(
            ["--base-url", server.base_url, "--num-prompts", "12", "--input-len", "20"]
            + ["--output-len", "6", "--seed", "3", "--output-json", str(out), *load]
        )
    assert code == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert results["completed"] == 12 and results["errors"] == 0
    assert results["output_tokens"] == 12 * 6
    assert results["output_tokens_per_s"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert 0 < results[key]["p50"] <= results[key]["p99"]
    assert report["config"]["engine"]["runner"] == "fake"
    assert report["config"]["model"] == "fake-model"
    printed = capsys.readouterr().out
    assert "20 random tokens in, 6 out" in printed and "TTFT" in printed


def test_bench_serve_counts_errors(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with serve_fake(step_s=0.002) as server:
        code = serve_bench_main(
            ["--base-url", server.base_url, "--model", "wrong", "--num-prompts", "3"]
            + ["--output-json", str(out)]
        )
    assert code == 1
    results = json.loads(out.read_text())["results"]
    assert results["completed"] == 0 and results["errors"] == 3
    assert "HTTP 404" in results["error_examples"][0]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--num-prompts", "0"], "--num-prompts"),
        (["--concurrency", "0"], "--concurrency"),
        (["--request-rate", "-1"], "--request-rate"),
        (["--concurrency", "2", "--request-rate", "3"], "--request-rate"),
        (["--input-len", "x"], "--input-len"),
    ],
)
def test_bench_serve_flag_errors_name_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serve_bench_main(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
