"""The scheduler micro-benchmark keeps working (its figures are read by people, not asserted)."""

from __future__ import annotations

import pytest

from davit_tools.bench import scheduler as bench_scheduler


def test_benchmark_runs_every_request_to_pure_decode() -> None:
    result = bench_scheduler.run(
        num_requests=32, prompt_len=40, num_steps=5, block_size=16, prefix_caching=True
    )
    assert result["prefill_steps"] >= 1
    assert result["decode_step_us"] > 0
    assert result["decode_us_per_request"] == pytest.approx(result["decode_step_us"] / 32)


def test_benchmark_cli_prints_its_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench_scheduler.main(["--num-requests", "8", "--prompt-len", "20", "--num-steps", "3"]) == 0
    )
    printed = capsys.readouterr().out
    assert "requests=8 prompt_len=20 steps=3 block_size=16" in printed
    assert "us per request" in printed
