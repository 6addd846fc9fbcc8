"""`python -m davit_tools.bench.api_stream` end to end: server child, core process, clients."""

from __future__ import annotations

import json
import os

import pytest

from davit_tools.bench.api_stream import main
from tests.engine.server.conftest import serve_fake


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_api_stream_bench_counts_every_token(
    capsys: pytest.CaptureFixture[str], client: str
) -> None:
    argv = ["--num-requests", "8", "--concurrency", "4", "--input-len", "16"]
    argv += ["--output-len", "9", "--tokens-per-step", "2", "--step-ms", "1", "--logprobs", "1"]
    # Not pinned: pinning would confine this test process to some CPUs for good.
    argv += ["--endpoint", "chat", "--client", client, "--no-pin"]
    assert main(argv) == 0
    config_line, json_line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "chat, 4 streams, 8 requests, 16 in / 9 out, 2 token(s) per step every 1 ms" in (
        config_line
    )
    report = json.loads(json_line)
    results = report["results"]
    assert results["completed"] == 8 and results["errors"] == 0
    assert results["tokens"] == 8 * 9
    assert 1 <= results["tokens_per_event"] <= 9
    assert results["tokens_per_s"] > 0 and results["api_cpu_s"] >= 0
    if results["tokens_per_event"] < 9:
        assert 0 <= results["itl_ms_p50"] <= results["itl_ms_p99"]
    else:  # a loaded machine can deliver each request's tokens in one event: no gap to time
        assert results["itl_ms_p50"] is None and results["itl_ms_p99"] is None
    assert report["config"]["client"] == client
    assert report["config"]["placement"].startswith("not pinned")


def test_api_stream_bench_measures_a_running_server(capsys: pytest.CaptureFixture[str]) -> None:
    """--base-url: the clients alone, against the app with the tests' fake core."""
    with serve_fake(step_s=0.002, max_num_seqs=8) as server:
        argv = ["--base-url", server.base_url, "--api-pid", str(os.getpid())]
        argv += ["--num-requests", "6", "--concurrency", "3", "--input-len", "12"]
        assert main([*argv, "--output-len", "7", "--logprobs", "1"]) == 0
    config_line, json_line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "the server's own engine" in config_line and server.base_url in config_line
    results = json.loads(json_line)["results"]
    assert results["completed"] == 6 and results["tokens"] == 6 * 7
    assert results["api_cpu_s"] is not None and results["core_cpu_util"] is None


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--tokens-per-step", "0"], "--tokens-per-step"),
        (["--step-ms", "-1"], "--step-ms"),
        (["--logprobs", "5"], "--logprobs"),
        (["--endpoint", "embeddings"], "--endpoint"),
        (["--api-pid", "1"], "--api-pid"),
        (["--base-url", "localhost:8000"], "--base-url"),
    ],
)
def test_api_stream_flag_errors_name_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
