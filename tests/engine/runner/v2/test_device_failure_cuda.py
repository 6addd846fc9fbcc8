"""Runner V2 on a real GPU: which failures the engine core isolates and which stop it.

Each scenario runs in its own process (a sticky CUDA error ends the process's CUDA context): an
engine core with a tiny random Qwen3 (CUDA graphs on) serves a few requests while one of them
triggers, from its third output on,
- `oom`: an allocation far beyond the GPU's memory: the device survives, so only that request
  fails and the others finish with the tokens of a run without it;
- `assert`: an out-of-range index on the device (a device-side assert, sticky);
- `block-table`: a block id far beyond the KV cache written into its block table, so its
  attention reads and writes outside the cache (an illegal memory access, sticky);
the sticky ones stop the core with a DeviceFailure that names the CUDA error, at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[4]
BAD = "bad"


def scenario(kind: str) -> None:
    """Run one scenario; print one JSON line with what happened."""
    from davit_engine.config import EngineConfig
    from davit_engine.engine_core import EngineCore
    from davit_engine.runner.base import DeviceFailure
    from davit_engine.runner.v2 import runner as v2_runner
    from davit_engine.runner.v2.state import RequestStateTable
    from davit_engine.types import EngineRequest, FinishReason, SamplingParams

    config = EngineConfig(
        model="random:qwen3-tiny",
        runner="v2",
        device="cuda",
        dtype="float32",
        num_gpu_blocks=64,
        block_size=8,
        max_num_seqs=4,
        max_model_len=128,
    )
    core = EngineCore(config)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = {f"ok{i}": [10 + i, 20, 30 + i, 40, 50 + i] for i in range(3)}

    def run(with_bad: bool) -> dict[str, Any]:
        for rid, prompt in prompts.items():
            core.add_request(EngineRequest(rid, prompt, greedy))
        if with_bad:
            core.add_request(EngineRequest(BAD, [7, 8, 9, 10], greedy))
        outputs: dict[str, list[int]] = {}
        finish: dict[str, str] = {}
        while core.has_unfinished_requests():
            for delta in core.step():
                outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                if delta.finish_reason is not None:
                    finish[delta.request_id] = delta.finish_reason.value
        return {"outputs": outputs, "finish": finish}

    reference = run(with_bad=False)["outputs"]

    def is_bad(scheduled: list[Any]) -> bool:
        return any(r.request_id == BAD and r.num_output_tokens >= 2 for r in scheduled)

    sample_step, stage = v2_runner.sample_step, RequestStateTable.stage

    def sampled(*args: Any, **kw: Any) -> Any:
        drawn = sample_step(*args, **kw)
        if is_bad(args[3]):
            logits = args[0]
            if kind == "oom":
                torch.empty(1 << 50, dtype=torch.uint8, device=logits.device)
            elif kind == "assert":
                index = torch.tensor([1 << 30], device=logits.device)
                logits[index] = 0.0
        return drawn

    def staged(table: RequestStateTable, batch: Any, *args: Any, **kw: Any) -> Any:
        rows = stage(table, batch, *args, **kw)
        if kind == "block-table" and is_bad(batch.scheduled):
            table.block_table[table.slot_of(BAD), 0] = 1 << 20
        return rows

    v2_runner.sample_step = sampled  # type: ignore[assignment]
    RequestStateTable.stage = staged  # type: ignore[method-assign]
    result: dict[str, Any] = {"kind": kind, "reference": reference}
    try:
        result.update(run(with_bad=True))
        stats = core.stats()
        result["clean"] = stats.num_free_blocks == stats.num_total_blocks
        result["stopped"] = None
    except DeviceFailure as exc:
        result["stopped"] = str(exc)
    print("RESULT " + json.dumps(result), flush=True)
    assert FinishReason.ERROR.value == "error"


def run_scenario(kind: str) -> dict[str, Any]:
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}
    code = f"from {__name__} import scenario; scenario({kind!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def test_an_allocation_that_does_not_fit_fails_only_its_request() -> None:
    result = run_scenario("oom")
    assert result["stopped"] is None
    assert result["finish"][BAD] == "error"
    assert len(result["outputs"].get(BAD, [])) == 2
    for rid, tokens in result["reference"].items():
        assert result["outputs"][rid] == tokens, rid
        assert result["finish"][rid] == "length"
    assert result["clean"]


@pytest.mark.parametrize("kind", ["assert", "block-table"])
def test_a_sticky_cuda_error_stops_the_core_naming_it(kind: str) -> None:
    result = run_scenario(kind)
    message = result["stopped"]
    assert message is not None, result
    expected = "device-side assert" if kind == "assert" else "illegal memory access"
    assert expected in message and "CUDA error" in message, message
    assert "restart" in message
