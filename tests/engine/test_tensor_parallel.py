"""Tensor parallelism on the CPU: ranks are processes joined by gloo, fp32.

Greedy output with the model split over ranks must equal the whole model's token for token
(random Llama and Qwen3 shapes at 2 ranks; the real SmolLM2-135M at 3 ranks, since its 9
attention heads and 3 KV heads refuse 2). A rank that dies ends the engine with an error naming
it: offline the next (or current) step raises, and `davit serve` reports it on /health.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from davit_engine.llm import LLM
from davit_engine.rank_workers import RankFailedError
from davit_engine.types import ParamError, SamplingParams
from tests.engine.server.harness import ServeProcess

# A small token budget so prompts are prefilled in chunks over several steps, and a prompt
# repeated after its first run so the prefix cache serves part of it.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "device": "cpu",
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "max_model_len": 256,
}
PROMPTS = [
    [1, 5, 9, 33, 200, 7, 8, 100, 101, 102, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26],
    [3, 4, 99],
    [300, 301, 302, 303, 304] * 7,
    [1, 5, 9, 33, 200, 7, 8, 100, 101, 102, 17, 18, 19, 20, 21, 22, 23, 24, 40, 41, 42],
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
CPU = torch.device("cpu")


def _greedy(model: str, size: int, prompts: list[Any], **args: Any) -> list[list[int]]:
    llm = LLM(model, tensor_parallel_size=size, **{**ENGINE_ARGS, **args})
    try:
        if size > 1:
            info = llm.core.model_info
            assert info.tensor_parallel_size == size
            assert info.memory_profile is not None
            assert info.memory_profile["identity"]["tensor_parallel_size"] == size
        if isinstance(prompts[0], str):
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], GREEDY)
        else:
            outputs = llm.generate(prompts[:3], GREEDY) + llm.generate(prompts[3:], GREEDY)
        return [o.token_ids for o in outputs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("shape", ["llama-tiny", "qwen3-tiny"])
def test_two_ranks_match_one_token_for_token(shape: str) -> None:
    model = f"random:{shape}"
    whole = _greedy(model, 1, PROMPTS, tokenizer="byte")
    split = _greedy(model, 2, PROMPTS, tokenizer="byte")
    assert split == whole
    assert len({tuple(t) for t in whole}) > 1  # not one degenerate answer for every prompt


def test_a_safetensors_directory_is_cut_per_rank_as_it_loads(qwen3_tiny_dir: Path) -> None:
    whole = _greedy(str(qwen3_tiny_dir), 1, PROMPTS, tokenizer="byte")
    split = _greedy(str(qwen3_tiny_dir), 2, PROMPTS, tokenizer="byte")
    assert split == whole


@pytest.mark.parametrize(
    "args",
    [
        {"quantization": "fp8"},
        {"kv_cache_dtype": "fp8"},
        {"quantization": "fp8", "lm_head_quantization": "fp8"},
        {"kv_cache_dtype": "fp8", "lm_head_quantization": "fp8"},
        {"quantization": "fp8", "lm_head_quantization": "int8"},
    ],
    ids=["weights", "kv", "weights-lm-head", "kv-lm-head", "weights-int8-lm-head"],
)
def test_fp8_two_ranks_match_one_token_for_token(args: dict[str, Any]) -> None:
    """FP8 weights are quantized before they are cut (a row-parallel projection's channel
    scales come from whole rows), the LM head per vocabulary row, and the KV cache's per-layer
    scales are the largest over every rank's heads: each rank holds its cut of the single-device
    model, so greedy tokens are the same (prefill chunks of at most 16 tokens here: the
    weight-only products, whose activations are not quantized)."""
    whole = _greedy("random:qwen3-tiny", 1, PROMPTS, tokenizer="byte", **args)
    split = _greedy("random:qwen3-tiny", 2, PROMPTS, tokenizer="byte", **args)
    assert split == whole
    bf16 = _greedy("random:qwen3-tiny", 1, PROMPTS, tokenizer="byte")
    assert whole != bf16  # the FP8 options changed the numbers they run on


def _logprobs(size: int, args: dict[str, Any]) -> list[list[float]]:
    llm = LLM("random:qwen3-tiny", tensor_parallel_size=size, tokenizer="byte",
              **{**ENGINE_ARGS, **args})  # fmt: skip
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=1)
        return [[t.logprob for t in o.logprobs or []] for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()


def test_fp8_weights_and_kv_on_two_ranks_stay_close_to_one() -> None:
    """With FP8 weights and an FP8 cache together the ranks differ from one device in one
    place: the KV scales' calibration prefill (512 tokens) runs the products that quantize
    their activations per token, and a row-parallel projection's ranks each take a token's
    scale over their own input columns. The scales, and so the cache's rounding, move a little;
    the first tokens' log-probabilities stay within 0.01 of one device's."""
    args = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    whole, split = _logprobs(1, args), _logprobs(2, args)
    assert [len(p) for p in split] == [len(p) for p in whole] == [3] * len(PROMPTS)
    gaps = [
        abs(a - b) for w, s in zip(whole, split, strict=True) for a, b in zip(w, s, strict=True)
    ]
    assert max(gaps) < 0.01


def test_fp8_checkpoints_are_cut_per_rank(qwen3_tiny_dir: Path, tmp_path: Path) -> None:
    """A checkpoint with per-tensor and per-channel scales, and a block-wise one (converted to
    channel scales before it is cut, or served with its own scales, cut with them), give the
    single-device tokens on two ranks."""
    from davit_engine.config import EngineConfig
    from davit_engine.loader import load_model
    from davit_tools.bench.fp8_quality import write_block_fp8_checkpoint
    from tests.engine.loader.test_fp8_checkpoints import _fp8_checkpoint

    _fp8_checkpoint(qwen3_tiny_dir, tmp_path / "channel")
    config = load_model(EngineConfig(model=str(qwen3_tiny_dir), dtype="float32"), CPU).config
    weights = list(load_file(str(qwen3_tiny_dir / "model.safetensors")).items())
    write_block_fp8_checkpoint(config, weights, tmp_path / "block", (32, 32))
    for name, args in (("channel", {}), ("block", {}), ("block", {"fp8_block_scales": "native"})):
        model = str(tmp_path / name)
        whole = _greedy(model, 1, PROMPTS, tokenizer="byte", **args)
        assert _greedy(model, 2, PROMPTS, tokenizer="byte", **args) == whole, (name, args)


@pytest.mark.slow
def test_smollm2_three_ranks_match_one_token_for_token(smollm2_gguf: Path) -> None:
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    whole = _greedy(str(smollm2_gguf), 1, questions)
    split = _greedy(str(smollm2_gguf), 3, questions)
    assert split == whole
    assert len(whole[1]) == GREEDY.max_tokens  # the haiku runs past the budget, no early EOS


@pytest.mark.parametrize(
    ("model", "args", "flag", "words"),
    [
        ("random:qwen2-tiny", {}, "--tensor-parallel-size", "1 KV heads"),
        ("random:qwen3-tiny", {"runner": "v2"}, "--runner", "does not support"),
        ("random:qwen3-tiny", {"kv_offloading_size": 1.0}, "--kv-offloading-size", "KV offload"),
    ],
)
def test_what_cannot_be_split_is_refused_by_flag(
    model: str, args: dict[str, Any], flag: str, words: str
) -> None:
    started = time.monotonic()
    with pytest.raises(ParamError) as info:
        LLM(model, tensor_parallel_size=2, tokenizer="byte", **{**ENGINE_ARGS, **args})
    assert info.value.param == flag
    assert words in info.value.message
    assert time.monotonic() - started < 10  # refused before any rank process starts


def test_a_killed_rank_ends_the_engine_naming_it() -> None:
    llm = LLM("random:qwen3-tiny", tensor_parallel_size=2, tokenizer="byte", **ENGINE_ARGS)
    try:
        assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
        ranks = llm.core.ranks
        assert ranks is not None
        pid = ranks.workers[1].pid
        assert pid is not None
        # Killed while generations run (up to the 256-token context each): the step in flight,
        # or the next one, fails.
        timer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
        timer.start()
        long = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match=rf"tensor-parallel rank 1 \(pid {pid}\)"):
            while time.monotonic() - started < 60:
                llm.generate([[1, 2, 3]] * 4, long)
        assert time.monotonic() - started < 30
        # And every later step, without waiting on the dead rank.
        with pytest.raises(RankFailedError, match="was killed by SIGKILL"):
            llm.generate([[4, 5, 6]], GREEDY)
    finally:
        llm.shutdown()


def _serve_two_ranks(log: Path) -> tuple[ServeProcess, int]:
    """`davit serve` over 2 ranks, ready and answering; (the server, rank 1's pid)."""
    server = ServeProcess(
        ["random:qwen3-tiny", "--tokenizer", "byte", "--device", "cpu", "--dtype", "float32"]
        + ["--tensor-parallel-size", "2", "--max-model-len", "256", "--max-num-batched-tokens"]
        + ["64"],
        log,
    )
    try:
        server.wait_ready(240)
        assert _complete(server).status_code == 200
        server.log()  # flushes the log file
        found = re.search(r"rank 1 pid (\d+)", server.log_path.read_text(errors="replace"))
        assert found, server.log()
    except BaseException:
        server.terminate()
        raise
    return server, int(found.group(1))


def _complete(server: ServeProcess) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "random:qwen3-tiny", "prompt": "abc", "max_tokens": 4},
        timeout=60,
    )


def _wait_unhealthy(server: ServeProcess, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    health = httpx.get(f"{server.base_url}/health", timeout=5)
    while health.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        health = httpx.get(f"{server.base_url}/health", timeout=5)
    return health


def test_a_rank_that_dies_while_the_server_idles_takes_the_engine_down(tmp_path: Path) -> None:
    server, rank1 = _serve_two_ranks(tmp_path / "serve.log")
    try:
        os.kill(rank1, signal.SIGKILL)
        health = _wait_unhealthy(server, 30)
        assert health.status_code == 503, server.log()
        assert f"tensor-parallel rank 1 (pid {rank1}) was killed by SIGKILL" in health.text
        reply = _complete(server)
        assert reply.status_code == 503
        assert "tensor-parallel rank 1" in reply.text
    finally:
        server.terminate()


def _state(pid: int) -> str:
    """The process's state letter (R, S, Z, ...); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def test_the_ranks_leave_with_the_engine_core(tmp_path: Path) -> None:
    """Rank 0 (the engine-core process) killed: the other ranks exit, none is left behind."""
    server, rank1 = _serve_two_ranks(tmp_path / "serve.log")
    try:
        core = int(Path(f"/proc/{rank1}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(core, signal.SIGKILL)
        assert _wait_unhealthy(server, 30).status_code == 503, server.log()
        deadline = time.monotonic() + 30
        # An exited rank may stay a zombie until the process that adopted it reaps it.
        while _state(rank1) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _state(rank1) in ("", "Z"), server.log()
    finally:
        server.terminate()
