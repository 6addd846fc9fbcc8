"""The workload definitions: what the notes say each workload is, the engine accepting them, and
the GPU suite building its requests from them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from davit_engine.bench.serve import build_parser as bench_serve_parser
from davit_engine.bench.serve import check_args as bench_serve_check
from davit_engine.server.cli import parse_args as serve_parse_args
from davit_tools.bench import gpu_suite
from davit_tools.bench.workloads import W1, W2, W3, OfflineWorkload, PeerShape, Warmup


def test_w1_lengths_from_the_seed_are_the_runs_lengths() -> None:
    w1 = W1()
    ins, outs = w1.lengths()
    assert len(ins) == len(outs) == w1.num_requests == 256
    assert min(ins) >= 100 and max(ins) <= 1024
    assert min(outs) >= 100 and max(outs) <= 1024
    # Run 1's figure counts 141,343 output tokens: the same draw, not merely the same range.
    assert (sum(ins), sum(outs)) == (140_271, 141_343)
    assert len(set(ins)) > 100 and len(set(outs)) > 100
    assert w1.lengths() == (ins, outs)
    # Nothing is cut short by the model length, and any prompt fits one prefill step.
    assert max(i + o for i, o in zip(ins, outs, strict=True)) <= w1.max_model_len
    assert max(ins) <= w1.max_num_batched_tokens
    # The kernel timings' W1 context is the mean context a decode step sees.
    mean_context = (sum(ins) + sum(outs) / 2) / w1.num_requests
    assert abs(mean_context - w1.decode_context) / w1.decode_context < 0.05
    assert (w1.temperature, w1.max_num_seqs, w1.max_num_batched_tokens) == (1.0, 256, 8192)


def test_w2_is_one_greedy_request_of_1024_in_and_256_out_on_the_llama_8b_shape() -> None:
    w2 = W2()
    assert w2.lengths() == ([1024], [256])
    assert w2.num_requests == 1 and w2.temperature == 0.0
    assert w2.model == "random:llama-3.1-8b"
    assert (w2.max_num_seqs, w2.max_num_batched_tokens, w2.max_model_len) == (8, 2048, 2048)
    assert w2.decode_tokens == 255 and w2.floor_context == 1152


def test_w2_floor_reads_the_notes_weight_and_kv_bytes() -> None:
    """The notes' floor: 15.0 GB of weights (embedding rows excluded, lm_head included) and
    0.15 GB of KV per decode step."""
    w2 = W2()
    shape = w2.shape()
    kv_bytes = 1152 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2 * 2
    weight_bytes = w2.bytes_per_decode_step() - kv_bytes
    assert round(weight_bytes / 1e9, 1) == 15.0
    assert round(kv_bytes / 1e9, 2) == 0.15
    # Another shape gives another floor: the model argument is used, not W2's own.
    assert w2.bytes_per_decode_step("random:qwen3-0.6b") < w2.bytes_per_decode_step() / 5


def test_peer_shape_is_the_transformers_peers_shape() -> None:
    peer = PeerShape()
    assert peer.lengths() == ([256] * 256, [256] * 256)
    assert peer.temperature == 0.0
    assert peer.model.removeprefix("random:") == peer.peer_model
    assert peer.input_len[0] + peer.output_len[0] <= peer.max_model_len


@pytest.mark.parametrize("workload", [W1(), W2(), PeerShape()], ids=["w1", "w2", "peer"])
def test_the_warmup_fits_every_offline_workloads_limits(workload: OfflineWorkload) -> None:
    warm = Warmup()
    assert max(warm.input_lens) + warm.output_len <= workload.max_model_len
    assert max(warm.input_lens) <= workload.max_num_batched_tokens
    assert len(warm.input_lens) <= workload.max_num_seqs


def test_w3_command_lines_parse_with_the_tools_own_parsers() -> None:
    w3 = W3()
    config, settings, _ = serve_parse_args(w3.serve_args(w3.model, 8765))
    assert config.model == "random:qwen3-0.6b" and config.tokenizer == "byte"
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 8192)
    assert config.max_model_len == 2048 and config.enable_prefix_caching is False
    assert settings.port == 8765

    parser = bench_serve_parser()
    for concurrency, num in w3.loads_for("v2-graphs"):
        args = parser.parse_args(w3.bench_args("http://127.0.0.1:8765", concurrency, num))
        bench_serve_check(parser, args)
        assert (args.input_len, args.output_len, args.temperature) == (1024, 128, 0.0)
        assert (args.concurrency, args.num_prompts) == (concurrency, num)
        assert num >= concurrency  # every load keeps its concurrency busy at least once
    assert [c for c, _ in w3.loads_for("v1")] == [c for c, _ in w3.loads] == [1, 16, 64]
    assert all(slow < fast for (_, slow), (_, fast) in zip(w3.slow_loads, w3.loads, strict=True))
    warm = parser.parse_args(w3.warmup_args("http://127.0.0.1:8765"))
    assert (warm.num_prompts, warm.input_len, warm.output_len) == (8, 1024, 16)


def test_the_suite_builds_each_workloads_requests() -> None:
    w1, w2 = W1(), W2()
    ins, outs = w1.lengths()
    requests = gpu_suite.workload_requests(w1, vocab=512)
    assert [len(r.prompt_token_ids) for r in requests] == ins
    assert [r.sampling.max_tokens for r in requests] == outs
    assert all(r.sampling.ignore_eos for r in requests)
    assert {r.sampling.temperature for r in requests} == {1.0}
    assert max(max(r.prompt_token_ids) for r in requests) < 512
    again = gpu_suite.workload_requests(w1, vocab=512)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]

    (single,) = gpu_suite.workload_requests(w2, vocab=512)
    assert len(single.prompt_token_ids) == 1024 and single.sampling.max_tokens == 256
    assert single.sampling.temperature == 0.0

    warm = gpu_suite.warmup_requests(vocab=512)
    assert [len(r.prompt_token_ids) for r in warm] == [300, 40, 700, 5]
    assert all(r.request_id.startswith("warm-") for r in warm)


def test_the_command_line_overrides_w1s_model_and_temperature_only() -> None:
    args = gpu_suite.argparse.Namespace(w1_model="random:qwen3-tiny", temperature=0.0)
    w1 = gpu_suite.w1_of(args)
    assert (w1.model, w1.temperature) == ("random:qwen3-tiny", 0.0)
    assert w1.lengths() == W1().lengths() and w1.engine_limits() == W1().engine_limits()


def test_the_definitions_import_without_torch_or_the_engine() -> None:
    code = (
        "import sys, davit_tools.bench.workloads as w; w.W1(); w.W3().serve_args('m', 1); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'davit_engine')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
