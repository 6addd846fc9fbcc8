"""`davit bench serve` against the app with the fake core: real HTTP, real streaming."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from davit_engine.bench.serve import (
    chunk_token_counts,
    percentile,
    serve_bench_main,
    token_itls,
)
from davit_engine.config import EngineConfig
from davit_engine.server.app import create_app
from davit_tools.bench import api_stream

from ..server.conftest import serve_fake
from ..server.harness import threaded_server


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
        (["--workers", "0"], "--workers"),
        (["--concurrency", "2", "--workers", "3"], "--workers"),
        (["--base-url", "localhost:8000"], "--base-url"),
        (["--base-url", "ftp://127.0.0.1"], "--base-url"),
    ],
)
def test_bench_serve_flag_errors_name_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serve_bench_main(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_chunk_token_counts_share_the_usage_total() -> None:
    # One character per token: the counts are the text lengths.
    assert chunk_token_counts([2, 3, 1], 6) == [2, 3, 1]
    # Four characters per token on average: one token each, the rest by text beyond one.
    assert chunk_token_counts([4, 8, 4], 4) == [1, 2, 1]
    assert sum(chunk_token_counts([5, 1, 9, 2], 11)) == 11
    # Tokens without text, chunks of one character: shared out evenly.
    assert chunk_token_counts([1, 1], 4) == [2, 2]
    # Usage in every chunk is exact; tokens counted after the last chunk go to it.
    assert chunk_token_counts([9, 9, 9], 6, [1, 4, 5]) == [1, 3, 2]
    with pytest.raises(ValueError, match="3 chunks with output but only 2 tokens"):
        chunk_token_counts([1, 1, 1], 2)
    with pytest.raises(ValueError, match="does not rise to 4 tokens"):
        chunk_token_counts([1, 1], 4, [3, 2])


def test_token_itls_spread_each_gap_over_its_tokens() -> None:
    # Chunks of 2, 3 and 1 tokens at 0, 30 and 70 ms: the first chunk's tokens are TTFT, the
    # next three tokens are 10 ms apart each, the last one 40 ms after them.
    itls = token_itls([0.0, 0.030, 0.070], [2, 3, 1])
    assert itls == pytest.approx([0.010, 0.010, 0.010, 0.040])
    # A chunk of no tokens adds no gap and does not restart the clock.
    assert token_itls([0.0, 0.005, 0.020], [1, 0, 2]) == pytest.approx([0.010, 0.010])


@contextlib.contextmanager
def serve_stream_core(tokens_per_step: int, step_s: float) -> Iterator[str]:
    """The real app and core process, with the API benchmark's core: N tokens every step."""
    settings = {
        api_stream.TOKENS_PER_STEP_ENV: str(tokens_per_step),
        api_stream.STEP_S_ENV: str(step_s),
    }
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)  # read by the spawned core process
    try:
        app = create_app(
            EngineConfig(model=api_stream.MODEL),
            core_factory=f"{api_stream.MODULE}:StreamCore",
            tokenizer_loader=api_stream._byte_tokenizer,
        )
        with threaded_server(app) as base_url:
            yield base_url
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_bench_serve_counts_multi_token_chunks_per_token(tmp_path: Path) -> None:
    """Three tokens per step every 15 ms: chunks carry several tokens, ITL stays per token."""
    out = tmp_path / "bench.json"
    step_s = 0.015
    with serve_stream_core(tokens_per_step=3, step_s=step_s) as base_url:
        code = serve_bench_main(
            ["--base-url", base_url, "--num-prompts", "6", "--concurrency", "3"]
            + ["--input-len", "8", "--output-len", "10", "--output-json", str(out)]
        )
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert results["completed"] == 6 and results["errors"] == 0
    # 10 tokens in steps of 3, 3, 3, 1: at most 4 chunks a request (fewer when steps merge).
    assert results["output_tokens"] == 6 * 10
    assert results["chunks"] <= 6 * 4 and results["tokens_per_chunk"] >= 2.5
    # Per token a third of a step; per chunk it would be a whole step.
    itl = results["itl_s"]
    assert step_s / 3 * 0.5 < itl["p50"] < step_s * 0.6, itl
    # The steps are 15 ms apart, so the tokens are 5 ms apart on average: tokens of one chunk
    # taken as 0 s apart (or chunks as one token each) would pull the mean far from that.
    assert step_s / 3 * 0.7 < itl["mean"] < step_s / 3 * 1.6, itl
    assert results["client_cpu_s"] > 0 and math.isfinite(results["client_cpu_us_per_token"])
    assert "per output token" in results["itl_definition"]


def test_bench_serve_spreads_the_load_over_worker_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    with serve_fake(step_s=0.002, max_num_seqs=8) as server:
        code = serve_bench_main(
            ["--base-url", server.base_url, "--num-prompts", "9", "--concurrency", "4"]
            + ["--input-len", "12", "--output-len", "5", "--workers", "2"]
            + ["--output-json", str(out)]
        )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["config"]["client"]["workers"] == 2
    results = report["results"]
    assert results["completed"] == 9 and results["output_tokens"] == 9 * 5
    assert 0 < results["ttft_s"]["p50"] <= results["e2e_s"]["p50"]
    printed = capsys.readouterr().out
    assert "client: 2 process(es)" in printed and "us per output token" in printed
