"""The GPU suite's `parity` section at tiny sizes: its comparison logic, a run of every family
through runner V1 on the CPU against transformers, SmolLM2's real weights against both
transformers references, and (on a CUDA device only) runner V2 with CUDA graphs as well."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from davit_tools.bench import gpu_suite

TINY_FAMILIES = "random:qwen3-tiny,random:llama-tiny,random:qwen2-tiny"


def run_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *argv: str) -> list[dict[str, Any]]:
    """`gpu_suite.main` with `argv`, its rows read back from results.jsonl."""
    monkeypatch.setattr(gpu_suite, "OUT", tmp_path)
    assert gpu_suite.main(["--sections", "parity", *argv]) == 0
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def rows_of(rows: list[dict[str, Any]], section: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["section"] == section]


def test_compare_greedy_counts_prefixes_and_gaps() -> None:
    ours = [[5, 6, 7], [1, 2, 3], [4, 9, 9], [8, 2]]
    theirs = [[5, 6, 7], [1, 2, 4], [3, 9, 9], [8, 2, 0]]
    logits = [torch.zeros(3, 10) for _ in ours]
    logits[1][2, 4], logits[1][2, 3] = 2.0, 1.5  # theirs chose 4 over our 3 by 0.5
    logits[2][0, 3], logits[2][0, 4] = 1.0, 0.999  # a near-tie at the first token
    result = gpu_suite.compare_greedy(ours, theirs, logits)
    assert result["identical_completions"] == "1/4"
    assert result["identical_first_token"] == "3/4"
    assert result["mean_matching_prefix"] == round((3 + 2 + 0 + 2) / 4, 2)
    assert result["mean_output_tokens"] == round(11 / 4, 2)
    assert result["first_difference_at"] == [[1, 2], [2, 0], [3, 2]]
    # The prompt that stopped early has no logit row to compare: no gap for it.
    assert result["logit_gap_at_first_difference"] == [0.001, 0.5]
    assert "logit_gap_at_first_difference" not in gpu_suite.compare_greedy(ours, ours)


def test_every_family_matches_transformers_through_v1_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 80-token prompts: past llama-tiny's original rope context (64), so the scaling matters.
    rows = run_suite(
        tmp_path, monkeypatch, "--parity-models", TINY_FAMILIES, "--parity-runners", "v1",
        "--parity-prompts", "4", "--parity-input-len", "80", "--parity-output-len", "12",
    )  # fmt: skip
    assert rows_of(rows, "error") == []
    parity = rows_of(rows, "parity_vs_transformers")
    assert [r["model"] for r in parity] == TINY_FAMILIES.split(",")
    for row in parity:
        assert row["runner"] == "v1-eager"
        assert row["reference"] == gpu_suite.REFERENCE_OURS
        assert row["eos"] == "ignored both sides"
        assert row["identical_completions"] == "4/4", row
        assert row["mean_output_tokens"] == 12
        assert row["logit_gap_at_first_difference"] == []


def test_a_changed_reference_shows_as_a_difference_with_its_gap() -> None:
    # The same path against a transformers model whose head never picks our first tokens.
    prompts = gpu_suite.parity_prompts("random:qwen3-tiny", 3, 20)
    core = gpu_suite.make_core(
        "random:qwen3-tiny", "v1", True, "float32", max_model_len=64, num_gpu_blocks=32
    )
    ours = gpu_suite.greedy_ours(core, prompts, 6)
    hf = gpu_suite._hf_from_ours(core)
    core.shutdown()
    theirs, logits = gpu_suite.greedy_transformers(hf, prompts, 6)
    assert theirs == ours
    banned = sorted({completion[0] for completion in ours})

    def lower_banned(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        output[..., banned] -= 100.0
        return output

    hf.lm_head.register_forward_hook(lower_banned)
    theirs, logits = gpu_suite.greedy_transformers(hf, prompts, 6)
    result = gpu_suite.compare_greedy(ours, theirs, logits)
    assert result["identical_first_token"] == "0/3"
    assert result["first_difference_at"] == [[0, 0], [1, 0], [2, 0]]
    assert all(gap > 0 for gap in result["logit_gap_at_first_difference"])


def test_missing_smollm2_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = run_suite(
        tmp_path, monkeypatch, "--parity-models", "", "--smollm2-gguf", str(tmp_path / "x.gguf")
    )
    (note,) = rows_of(rows, "parity_note")
    assert "--smollm2-gguf" in note["skipped"]
    assert rows_of(rows, "error") == [] and rows_of(rows, "parity_vs_transformers") == []


def test_too_many_chat_prompts_is_an_error_naming_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path
) -> None:
    rows = run_suite(
        tmp_path, monkeypatch, "--parity-models", "", "--smollm2-gguf", str(smollm2_gguf),
        "--parity-prompts", str(len(gpu_suite.PARITY_CHAT) + 1),
    )  # fmt: skip
    (error,) = rows_of(rows, "error")
    assert "--parity-prompts" in error["error"]


@pytest.mark.slow
def test_smollm2_matches_both_transformers_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path
) -> None:
    pytest.importorskip("gguf")
    rows = run_suite(
        tmp_path, monkeypatch, "--parity-models", "", "--smollm2-gguf", str(smollm2_gguf),
        "--parity-runners", "v1", "--parity-prompts", "2", "--parity-output-len", "24",
    )  # fmt: skip
    assert rows_of(rows, "error") == []
    parity = rows_of(rows, "parity_vs_transformers")
    assert {r["reference"] for r in parity} == {gpu_suite.REFERENCE_OURS, gpu_suite.REFERENCE_GGUF}
    for row in parity:
        assert row["eos"] == "honoured both sides: stop at [2]"
        assert row["identical_completions"] == "2/2", row
        assert row["input_len"].endswith("(chat template)")
        assert row["sample"].startswith("The capital of France is Paris")
    (refs,) = rows_of(rows, "parity_between_references")
    assert refs["identical_completions"] == "2/2"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_v2_graphs_and_v1_match_transformers_on_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = run_suite(
        tmp_path, monkeypatch, "--parity-models", TINY_FAMILIES, "--parity-prompts", "4",
        "--parity-input-len", "80", "--parity-output-len", "12",
    )  # fmt: skip
    assert rows_of(rows, "error") == []
    parity = rows_of(rows, "parity_vs_transformers")
    assert {(r["model"], r["runner"]) for r in parity} == {
        (m, runner) for m in TINY_FAMILIES.split(",") for runner in ("v2-graphs", "v1-eager")
    }
    for row in parity:
        assert row["identical_completions"] == "4/4", row
        if row["runner"] == "v2-graphs":
            assert row["graph_steps"] > 0
    between = rows_of(rows, "parity_between_runners")
    assert [r["identical_completions"] for r in between] == ["4/4"] * 3
