"""The FP8 bench's own logic on the CPU: interleaved rounds, their summary, and arguments it
refuses (the timed workloads themselves run on a GPU)."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from davit_tools.bench import fp8


def test_rounds_summary_gives_medians_and_the_ratio_of_medians() -> None:
    rows = fp8.rounds_summary({"bf16": [100.0, 90.0, 120.0], "fp8-kv": [130.0, 150.0, 110.0]})
    assert [r["variant"] for r in rows] == ["bf16", "fp8-kv"]
    assert rows[0] == {"variant": "bf16", "runs": 3, "median": 100.0, "min": 90.0, "max": 120.0,
                       "median_over_first": 1.0}  # fmt: skip
    assert rows[1]["median"] == 130.0 and rows[1]["median_over_first"] == 1.3
    assert (rows[1]["min"], rows[1]["max"]) == (110.0, 150.0)


def test_w1_rounds_interleave_the_variants_and_record_a_summary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []
    speed = {"bf16": iter([100.0, 104.0, 96.0]), "fp8-kv": iter([125.0, 135.0, 128.0])}

    def run(workload: Any, variant: fp8.Variant, copy_bw: float) -> dict[str, Any]:
        calls.append(variant.name)
        return {"outputs": {}, "output_tok_s": next(speed[variant.name]), "elapsed_s": 1.0}

    monkeypatch.setattr(fp8, "_run_workload", run)
    monkeypatch.setattr(fp8, "versions", lambda: {})
    monkeypatch.setattr(fp8, "OUT", tmp_path)
    monkeypatch.setattr(fp8, "ROWS", [])
    assert fp8.main(["--sections", "w1", "--w1-variants", "bf16,fp8-kv", "--rounds", "3"]) == 0
    assert calls == ["bf16", "fp8-kv"] * 3
    rows = [json.loads(line) for line in (tmp_path / "fp8.jsonl").read_text().splitlines()]
    runs = [r for r in rows if r["section"] == "w1"]
    assert [(r["variant"], r["round"]) for r in runs] == [
        ("bf16", 1), ("fp8-kv", 1), ("bf16", 2), ("fp8-kv", 2), ("bf16", 3), ("fp8-kv", 3)
    ]  # fmt: skip
    summary = {r["variant"]: r for r in rows if r["section"] == "w1-rounds"}
    assert summary["bf16"]["median"] == 100.0
    assert summary["fp8-kv"]["median"] == 128.0 and summary["fp8-kv"]["median_over_first"] == 1.28


def test_w1_prefill_runs_the_prompts_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`w1-prefill`: W1's requests with one output token each (the same prompts), its figure
    the prompt tokens over the run's time."""
    seen: list[Any] = []

    def run(workload: Any, variant: fp8.Variant, copy_bw: float) -> dict[str, Any]:
        seen.append(workload)
        return {"outputs": {}, "output_tok_s": 1.0, "elapsed_s": 2.0}

    monkeypatch.setattr(fp8, "_run_workload", run)
    monkeypatch.setattr(fp8, "versions", lambda: {})
    monkeypatch.setattr(fp8, "OUT", tmp_path)
    monkeypatch.setattr(fp8, "ROWS", [])
    assert fp8.main(["--sections", "w1-prefill", "--w1-variants", "bf16,fp8-kv"]) == 0
    inputs, outputs = seen[0].lengths()
    assert inputs == fp8.W1().lengths()[0] and set(outputs) == {1}
    rows = [json.loads(line) for line in (tmp_path / "fp8.jsonl").read_text().splitlines()]
    prefill = [r for r in rows if r["section"] == "w1-prefill"]
    assert [r["variant"] for r in prefill] == ["bf16", "fp8-kv"]
    assert prefill[0]["prompt_tokens"] == sum(inputs)
    assert prefill[0]["prefill_tok_s"] == round(sum(inputs) / 2.0, 1)


def test_kernel_figures_count_overlapping_kernels_once() -> None:
    """Busy time is the union of the kernel intervals (a kernel launched with programmatic
    dependent launch starts before the one before it ends); the sum counts each kernel."""
    spans = [
        ("attention", 0.0, 100.0),
        ("merge", 60.0, 110.0),  # overlaps the attention's tail
        ("attention", 200.0, 300.0),
        ("norm", 300.0, 310.0),  # touches: one busy stretch
    ]
    figures = fp8.kernel_figures(spans, top=2)
    assert (figures["span_s"], figures["busy_s"], figures["sum_s"]) == (3.1e-4, 2.2e-4, 2.6e-4)
    assert figures["top"][0] == ["attention", 0.0002, 2]
    assert [name for name, _, _ in figures["top"]] == ["attention", "merge"]
    # idle: one gap of 90 us between the merge (the busy stretch's last end) and the attention
    assert figures["idle"]["classes"]["20-100us"] == [1, 9e-05]
    assert sum(count for count, _ in figures["idle"]["classes"].values()) == 1
    assert figures["idle"]["longest"] == [[90.0, "merge", "attention"]]
    empty = fp8.kernel_figures([])
    assert (empty["span_s"], empty["busy_s"], empty["sum_s"], empty["top"]) == (0.0, 0.0, 0.0, [])
    assert empty["idle"]["longest"] == []


def test_idle_figures_classes() -> None:
    """Gaps fall in classes by length; their seconds add up; the longest come first."""
    gaps = [
        (3.0, "a", "b"),
        (7.0, "b", "c"),
        (250.0, "c", "d"),
        (1500.0, "d", "e"),
        (20.0, "e", "f"),
    ]
    idle = fp8.idle_figures(gaps, longest=2)
    assert idle["classes"] == {
        "<5us": [1, 3e-06], "5-20us": [1, 7e-06], "20-100us": [1, 2e-05],
        "100-1000us": [1, 0.00025], ">=1000us": [1, 0.0015],
    }  # fmt: skip
    assert idle["longest"] == [[1500.0, "d", "e"], [250.0, "c", "d"]]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--rounds", "0"], "--rounds"),
        (["--w1-variants", "bf16,fp9"], "--w1-variants"),
        (["--w2-variants", "fp8"], "--w2-variants"),
        (["--sections", "w1,speed"], "--sections"),
        (["--gemv-configs", "8/512/4/0/q"], "--gemv-configs"),
        (["--gemv-configs", "8/512/4"], "--gemv-configs"),
        (["--gemv-configs", "8/512/4/0/1"], "--gemv-configs"),
        (["--gemv-configs", "8/512/4/0/3/2"], "--gemv-configs"),
        (["--gemv-configs", "8/512/4/0/3/1/3"], "--gemv-configs"),
        (["--gemv-configs", "8/512/4/0/0/0/2/1"], "--gemv-configs"),
        (["--gemm-configs", "32/512/x/4"], "--gemm-configs"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        fp8.main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("fails", [False, True])
def test_run_workload_sets_the_gate_activation_switch_while_the_engine_exists(
    monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """`fp8-both-separate-silu` turns the fused SiLU x up off from before the engine is made
    (its graphs are captured there) until it is shut down, and back on afterwards, also when
    the engine fails to start."""
    from davit_engine.runner.v2 import fused_layers
    from davit_tools.bench import gpu_suite

    seen: list[bool] = []

    class Core:
        model_info = types.SimpleNamespace(vocab_size=10, num_blocks=3)
        memory_profile = None

        def shutdown(self) -> None:
            seen.append(fused_layers.FUSE_FP8_GATE_ACTIVATION)

    def make_core(*args: Any, **kwargs: Any) -> Core:
        seen.append(fused_layers.FUSE_FP8_GATE_ACTIVATION)
        if fails:
            raise RuntimeError("no GPU")
        return Core()

    monkeypatch.setattr(gpu_suite, "make_core", make_core)
    monkeypatch.setattr(gpu_suite, "_engine_loop", lambda core, requests: {})
    monkeypatch.setattr(gpu_suite, "warmup_requests", lambda vocab: [])
    monkeypatch.setattr(gpu_suite, "workload_requests", lambda workload, vocab: [])
    monkeypatch.setattr(gpu_suite, "free_memory", lambda: None)
    variant = fp8.VARIANTS["fp8-both-separate-silu"]
    if fails:
        with pytest.raises(RuntimeError):
            fp8._run_workload(fp8.W2(), variant, 1e12)
        assert seen == [False]
    else:
        assert fp8._run_workload(fp8.W2(), variant, 1e12)["num_blocks"] == 3
        assert seen == [False, False]
    assert fused_layers.FUSE_FP8_GATE_ACTIVATION is True


def test_gemv_configs_parse() -> None:
    auto, split = fp8._parse_gemv_configs("8/512/4/0;4/1024/4/2")
    assert auto.label == "gemv_8x512w4sauto" and split.split_k == 2
    assert split.label == "gemv_4x1024w4s2"
    streamed, preloaded = fp8._parse_gemv_configs("8/512/4/0/3;8/256/2/0/4/1")
    assert (streamed.stages, streamed.preload, streamed.label) == (3, 0, "gemv_8x512w4sautot3")
    assert (preloaded.num_warps, preloaded.stages, preloaded.preload) == (2, 4, 1)
    assert preloaded.label == "gemv_8x256w2sautot4p"
    (plain_preload,) = fp8._parse_gemv_configs("8/512/4/0/0/1")
    assert (plain_preload.stages, plain_preload.preload) == (0, 1)
    assert plain_preload.label == "gemv_8x512w4sautop"
    (unrolled,) = fp8._parse_gemv_configs("8/512/4/0/0/0/2")
    assert (unrolled.stages, unrolled.unroll, unrolled.label) == (0, 2, "gemv_8x512w4sautou2")
    bad_ones = ("8/512/4/0/1", "8/512/4/0/0/2", "8/512/4", "8/512/4/0/3/1/3", "8/512/4/0/0/0/2/1",
                "8/x/4/0")  # fmt: skip
    for bad in bad_ones:
        with pytest.raises(ValueError, match="--gemv-configs"):
            fp8._parse_gemv_configs(bad)


def test_variant_switches_name_existing_engine_attributes() -> None:
    """Every switch a variant sets exists in the engine (a renamed switch fails here, not on
    the GPU)."""
    import importlib

    switches = [sw for variant in fp8.VARIANTS.values() for sw in variant.switches]
    assert switches
    for module_name, attribute, value in switches:
        current = getattr(importlib.import_module(module_name), attribute)
        # an optional setting may be switched off (None) or on
        assert type(current) is type(value) or None in (current, value), (attribute, value)
        assert current != value, (attribute, value)


def test_kernel_rows_are_built_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gemm and attention sections' rows at tiny shapes on the CPU (Triton's interpreter),
    each timing replaced by one call: every field the GPU call records is there, the epilogue
    activation equals the separate kernel, and no variant reports an error."""
    import torch

    from davit_engine.layers.fp8 import FP8_MAX, quantize_fp8
    from davit_tools.bench import timing

    def once(fn: Any, replays: int) -> float:
        fn()
        return 1.0

    monkeypatch.setattr(timing, "graph_us", once)
    torch.manual_seed(0)
    bf16 = [torch.randn(32, 256, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    scales = [w.float().abs().amax(dim=1) / FP8_MAX for w in bf16]
    weights = [quantize_fp8(w, s[:, None]) for w, s in zip(bf16, scales, strict=True)]
    gemv = fp8._parse_gemv_configs("8/128/4/0;8/128/4/2;8/128/4/0/3/1")
    row = fp8._gemm_rows("gate_up", bf16, weights, scales, 1, [], gemv)
    for key in ("bf16_us", "default_us", "gemv_8x128w4sauto_us", "gemv_8x128w4s2_us",
                "gemv_8x128w4sautot3p_us",
                "act_separate_us", "act_gated_us", "best"):  # fmt: skip
        assert key in row, key
    assert row["act_gated_equal"] is True
    assert not [key for key in row if key.endswith("_error")]
    row = fp8._attention_shape("tiny", 2, 40, 4, 2, device="cpu", splits=2, sweep_splits=(3,))
    for key in ("bf16_us", "fp8_us", "fp8_q_tile_us", "fp8_uncapped_us",
                "speedup", "write_fp8_us", "write_bf16_us", "bf16_s3_us",
                "fp8_s3_us"):  # fmt: skip
        assert key in row, key
    assert row["splits"] == 2


def test_w1_trajectory_row_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `w1-trajectory` row at tiny heads on the CPU (Triton's interpreter), each timing one
    call and the split choice a GPU's stand-in (three splits): every way of splitting is
    there, balanced included."""
    from davit_engine.kernels import paged_attention as pa
    from davit_tools.bench import timing

    calls: list[int] = []

    def once(fn: Any, replays: int) -> float:
        fn()
        calls.append(1)
        return 2.0

    monkeypatch.setattr(timing, "graph_us", once)
    monkeypatch.setattr(fp8, "w1_decode_step", lambda step: [5, 40, 17])
    monkeypatch.setattr(pa, "default_num_splits", lambda *args, **kwargs: 3)
    monkeypatch.setattr(pa, "multiprocessors", lambda device: 4)
    row = fp8._trajectory_row(7, device="cpu", heads=(4, 2, 16))
    assert (row["step"], row["requests"], row["max_context"], row["mean_context"]) == (7, 3, 40, 21)
    for key in ("bf16_us", "fp8_us", "fp8_2w_us", "bf16_bal_us", "fp8_bal_us", "bf16_mean_us",
                "fp8_mean_us", "fp8_2w_mean_us", "bf16_bal2_us", "bf16_bal4_us", "fp8_bal2_us",
                "fp8_bal4_us"):  # fmt: skip
        assert row[key] == 2.0, key
    assert row["fp8_bal_splits"] == 3 and row["speedup"] == 1.0
    # the model's figure beside each timing: balanced runs cut the longest program
    assert row["fp8_model"] > 0 and row["fp8_bal_model"] <= row["fp8_model"]
    assert len(calls) == 12
    assert pa.BALANCE_SPLITS is False and pa.SPLIT_WAVES == {"model": 2.0, "fp8": 2.0}
    assert pa.BALANCED_WAVES == {"model": 3.0, "fp8": 3.0}


def test_w1_decode_steps_follow_the_workload() -> None:
    inputs, outputs = fp8.W1().lengths()
    first = fp8.w1_decode_step(0)
    assert first == inputs  # every output is at least 100 tokens
    later = fp8.w1_decode_step(500)
    assert len(later) == sum(o > 500 for o in outputs) and min(later) >= 600


def test_launch_groups_split_a_kernel_by_launch_shape() -> None:
    """Launches of the grouped kernels by (grid, block, registers, shared memory), largest
    total first; other kernels, CPU events and events without a duration are left out."""
    attention = "_paged_attention_kernel"

    def kernel(name: str, dur: float, grid: list[int], regs: int = 128) -> dict[str, Any]:
        args = {"grid": grid, "block": [64, 1, 1], "registers per thread": regs,
                "shared memory": 22528}  # fmt: skip
        return {"ph": "X", "cat": "kernel", "name": name, "dur": dur, "args": args}

    trace = {
        "traceEvents": [
            kernel(attention, 100.0, [256, 8, 1]),
            kernel(attention, 50.0, [144, 8, 2]),
            kernel(attention, 120.0, [256, 8, 1]),
            kernel("_qk_norm_rope_kernel", 9.0, [256, 1, 1], regs=164),
            kernel("ampere_bf16_gemm", 500.0, [8, 8, 1]),
            {"ph": "X", "cat": "cpu_op", "name": attention, "dur": 1e6},
            {"ph": "i", "cat": "kernel", "name": attention},
        ]
    }
    groups = fp8.launch_groups(trace)
    assert groups[attention] == [
        [[256, 8, 1], [64, 1, 1], 128, 22528, 0.00022, 2],
        [[144, 8, 2], [64, 1, 1], 128, 22528, 5e-05, 1],
    ]
    assert groups["_qk_norm_rope_kernel"] == [[[256, 1, 1], [64, 1, 1], 164, 22528, 9e-06, 1]]
    assert groups["_merge_splits_kernel"] == []
    assert fp8.launch_groups({}) == {name: [] for name in fp8.GROUPED_KERNELS}


def test_w2_floor_counts_each_variant_s_bytes() -> None:
    """The W2 floor's bytes per step: FP8 projections halve theirs, an FP8 LM head halves the
    head's (vocabulary x hidden, plus a scale per row), an FP8 cache the KV reads."""
    from davit_tools.bench.workloads import W2, model_shape

    w2 = W2()
    c = model_shape(w2.model)
    bf16, both, head = (fp8.w2_floor_bytes(w2, fp8.VARIANTS[name])
                        for name in ("bf16", "fp8-both", "fp8-both-lm-head"))  # fmt: skip
    assert both - head == c.vocab_size * c.hidden_size - 4 * c.vocab_size
    assert 7.9e9 < both < 8.4e9 < 14.9e9 < bf16 < 15.5e9


def test_variants_joined_by_plus_set_every_part_and_refuse_conflicts() -> None:
    """Variants joined with "+" run their switches together, with agreed precision settings; parts
    that disagree on a precision or set one switch twice are refused, naming the variant."""
    joined = fp8.variant_named("fp8-both-stream4-preload+fp8-both-lm-head")
    assert joined.name == "fp8-both-stream4-preload+fp8-both-lm-head"
    assert (joined.quantization, joined.kv_cache_dtype, joined.lm_head_quantization) == (
        "fp8",
        "fp8",
        "fp8",
    )
    assert joined.switches == fp8.VARIANTS["fp8-both-stream4-preload"].switches
    w1 = fp8.variant_named("fp8-kv-balanced+fp8-kv-rotary-4w")
    assert w1.kv_cache_dtype == "fp8" and w1.quantization is None
    assert {(m.rsplit(".", 1)[-1], a) for m, a, _ in w1.switches} == {
        ("paged_attention", "BALANCE_SPLITS"),
        ("layer_ops", "ROTARY_FP8_NUM_WARPS"),
    }
    assert fp8.variant_named("bf16") is fp8.VARIANTS["bf16"]
    with pytest.raises(ValueError, match="disagree on kv_cache_dtype"):
        fp8.variant_named("bf16-balanced+fp8-kv")
    with pytest.raises(ValueError, match="same switch twice"):
        fp8.variant_named("fp8-kv-rotary-4w+fp8-kv-rotary-4w-reg")
    with pytest.raises(ValueError, match="unknown variant"):
        fp8.variant_named("fp8-both+nonsense")
    with pytest.raises(SystemExit):
        fp8.main(["--w2-variants", "fp8-both,bf16+fp8-both", "--sections", "w2"])
