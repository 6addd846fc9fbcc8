"""The operator half of `make demo`, end to end on its own local control plane."""

from __future__ import annotations

import pytest

from davit_tools.demo import DEFAULT_EXAMPLES, run_demo

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_demo_settles_every_example(capsys: pytest.CaptureFixture[str]) -> None:
    """Every example becomes Ready with a Deployment on the fake nodes (memory from the
    operator's estimate: fake nodes take no profile) and the refused spec stalls with why."""
    assert run_demo(list(DEFAULT_EXAMPLES), timeout=120.0) == 0
    out = capsys.readouterr().out
    assert "result: every example Ready, the refusal explained" in out
    assert "source: estimate" in out
    assert "no Deployment" not in out
    assert "Stalled=True (NoRunnerSupports)" in out
    assert "runner V2 refuses parallelism.dualBatchOverlap with parallelism.pipeline 2" in out
    assert "runner V1 was last shipped in 0.33.0" in out
