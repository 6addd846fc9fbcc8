"""The benchmark workloads that the figures in docs/bench-notes.md refer to, as data.

Each workload is a frozen dataclass whose field defaults are its definition and whose docstring
says what it is and which figure it reports; `gpu_suite`, `w2_kernels` and `kernel_timing` take
their shapes, lengths and engine limits from here, so "W1" in a note and in the code are the
same thing. Changing a default changes what every later figure means: record it in the notes.

Importing this module needs neither torch nor the engine: the methods that draw lengths or look
up a model shape import them when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from davit_engine.models.config import ModelConfig

RANDOM_PREFIX = "random:"


def model_shape(model: str) -> ModelConfig:
    """The shape of a `random:<shape>` model name (or a bare shape name)."""
    from davit_engine.shapes import get_shape

    return get_shape(model.removeprefix(RANDOM_PREFIX))


class EngineLimits(TypedDict):
    """The EngineConfig keyword arguments that bound a workload's batching (typed by key, so
    `**limits` cannot land on another parameter)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class Warmup:
    """Requests run on the same engine just before a timed offline workload, so Triton compiles
    every prefill kernel variant outside the timing: 4 requests of 300, 40, 700 and 5 prompt
    tokens, 4 output tokens each, temperature 1.0, prompt ids from seed 99."""

    input_lens: tuple[int, ...] = (300, 40, 700, 5)
    output_len: int = 4
    temperature: float = 1.0
    prompt_seed: int = 99


@dataclass(frozen=True)
class OfflineWorkload:
    """Requests added to one engine core together and run to the end, no HTTP in between.

    Every request has random prompt ids (uniform over the model's vocabulary, one torch
    generator seeded with `prompt_seed`), ignores EOS so it produces exactly its output length,
    and samples at `temperature` (0: greedy) without top-k, top-p or a per-request seed. The
    engine runs with prefix caching off and the limits below (EngineConfig fields of the same
    names). Lengths are `input_len` / `output_len` for every request when `length_seed` is None;
    otherwise each is drawn uniformly in its inclusive range from one torch generator seeded
    with `length_seed`, all input lengths first, then all output lengths.
    """

    model: str
    num_requests: int
    input_len: tuple[int, int]  # inclusive range; both ends equal: every request alike
    output_len: tuple[int, int]
    length_seed: int | None
    prompt_seed: int
    temperature: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def lengths(self) -> tuple[list[int], list[int]]:
        """(input lengths, output lengths), one of each per request."""
        if self.length_seed is None:
            fixed_in, fixed_out = self.input_len[0], self.output_len[0]
            return [fixed_in] * self.num_requests, [fixed_out] * self.num_requests
        import torch

        gen = torch.Generator().manual_seed(self.length_seed)
        (in_low, in_high), (out_low, out_high) = self.input_len, self.output_len
        inputs = torch.randint(in_low, in_high + 1, (self.num_requests,), generator=gen)
        outputs = torch.randint(out_low, out_high + 1, (self.num_requests,), generator=gen)
        return inputs.tolist(), outputs.tolist()

    def engine_limits(self) -> EngineLimits:
        """The EngineConfig keyword arguments this workload runs under."""
        return EngineLimits(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )

    def shape(self) -> ModelConfig:
        return model_shape(self.model)


@dataclass(frozen=True)
class W1(OfflineWorkload):
    """W1, offline throughput: the Qwen3-0.6B shape (bf16 random weights), 256 requests with
    input and output lengths uniform in [100, 1024] (torch generator seed 0: 140,271 prompt and
    141,343 output tokens), prompt ids from seed 0, EOS ignored, temperature 1.0, no top-k/top-p;
    max_num_seqs 256, max_num_batched_tokens 8192, max_model_len 2048.

    Figure: output tokens / wall time from the first `add_request` to the last token, after a
    `Warmup` on the same engine. `decode_context` is the mean context of a decode step at full
    batch (notes, "The two numbers first"), the shape the kernel timings use for W1.
    """

    model: str = "random:qwen3-0.6b"
    num_requests: int = 256
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    length_seed: int | None = 0
    prompt_seed: int = 0
    temperature: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    decode_context: int = 840


@dataclass(frozen=True)
class W2(OfflineWorkload):
    """W2, single-request latency: the Llama-3.1-8B shape (bf16 random weights), batch 1,
    1024 prompt tokens (ids from seed 0), 256 output tokens, greedy, EOS ignored;
    max_num_seqs 8, max_num_batched_tokens 2048, max_model_len 2048.

    Figures: decode tokens/s (the 255 tokens after the first / the time after the first token),
    output tokens/s, and the share of the bandwidth floor: copy bandwidth / (weight bytes read
    per step + KV bytes at the mean decode context of 1152 tokens). `measured_floor_tok_s` is
    that floor with run 2's measured copy bandwidth, which later runs compare against.
    """

    model: str = "random:llama-3.1-8b"
    num_requests: int = 1
    input_len: tuple[int, int] = (1024, 1024)
    output_len: tuple[int, int] = (256, 256)
    length_seed: int | None = None
    prompt_seed: int = 0
    temperature: float = 0.0
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    measured_floor_tok_s: float = 279.8

    @property
    def decode_tokens(self) -> int:
        """Tokens timed by the decode rate: all but the first, which the prefill produces."""
        return self.output_len[0] - 1

    @property
    def floor_context(self) -> int:
        """The context the floor's KV bytes are counted at: the mean over the decode steps."""
        return self.input_len[0] + self.output_len[0] // 2

    def bytes_per_decode_step(self, model: str | None = None) -> int:
        """Bytes one decode step must read at `floor_context` (bf16): every weight except the
        embedding rows (the lm_head is read), plus K and V of every layer. `model` defaults to
        W2's own shape."""
        c = model_shape(model or self.model)
        weight_bytes = 2 * (c.num_parameters() - c.vocab_size * c.hidden_size)
        kv_bytes = self.floor_context * c.num_layers * c.num_kv_heads * c.head_dim * 2 * 2
        return weight_bytes + kv_bytes


@dataclass(frozen=True)
class PeerShape(OfflineWorkload):
    """The transformers peer comparison: the Qwen3-0.6B shape (bf16), 256 requests of 256
    prompt tokens (ids from seed 0) and 256 output tokens, greedy, EOS ignored; ours on runner
    V2 with CUDA graphs at max_num_seqs 256, max_num_batched_tokens 8192, max_model_len 1024;
    theirs the peer script's `hf(peer_model, [256], inp=256, out=256)` (transformers
    `generate()`, same process, same shape).

    Figure: our output tokens/s / transformers' output tokens/s.
    """

    model: str = "random:qwen3-0.6b"
    num_requests: int = 256
    input_len: tuple[int, int] = (256, 256)
    output_len: tuple[int, int] = (256, 256)
    length_seed: int | None = None
    prompt_seed: int = 0
    temperature: float = 0.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 1024
    peer_model: str = "qwen3-0.6b"


@dataclass(frozen=True)
class W3:
    """W3, online serving: `davit serve` on the Qwen3-0.6B shape (bf16 random weights, byte
    tokenizer, max_num_seqs 256, max_num_batched_tokens 8192, max_model_len 2048, prefix caching
    off) in its own process, loaded by `davit bench serve` over HTTP: 1024 random prompt ids
    (the load generator's default seed 0) and 128 output tokens per request, EOS ignored,
    greedy, at each (concurrency, number of prompts) of `loads`; runners slower than V2 with
    CUDA graphs get `slow_loads`, which fit the same call. Before the timed loads, one
    untimed run (`warmup_args`) lets Triton compile the eager kernels.

    Figures per load: TTFT, TPOT and ITL (p50 / p99) and output tokens/s, as `davit bench
    serve` reports them.
    """

    model: str = "random:qwen3-0.6b"
    tokenizer: str = "byte"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    input_len: int = 1024
    output_len: int = 128
    temperature: float = 0.0
    loads: tuple[tuple[int, int], ...] = ((1, 8), (16, 64), (64, 192))
    slow_loads: tuple[tuple[int, int], ...] = ((1, 4), (16, 32), (64, 128))
    warmup_prompts: int = 8
    warmup_output_len: int = 16

    def serve_args(self, model: str, port: int) -> list[str]:
        """`davit serve` arguments (after `serve`) for `model` on `port`."""
        return [
            model,
            "--tokenizer", self.tokenizer,
            "--port", str(port),
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--no-enable-prefix-caching",
        ]  # fmt: skip

    def bench_args(self, base_url: str, concurrency: int, num_prompts: int) -> list[str]:
        """`davit bench serve` arguments (after `serve`) for one timed load."""
        return [
            "--base-url", base_url,
            "--num-prompts", str(num_prompts),
            "--input-len", str(self.input_len),
            "--output-len", str(self.output_len),
            "--concurrency", str(concurrency),
            "--temperature", f"{self.temperature:g}",
        ]  # fmt: skip

    def warmup_args(self, base_url: str) -> list[str]:
        """`davit bench serve` arguments of the untimed run (the tool's default temperature:
        only compilation matters here)."""
        return [
            "--base-url", base_url,
            "--num-prompts", str(self.warmup_prompts),
            "--input-len", str(self.input_len),
            "--output-len", str(self.warmup_output_len),
            "--concurrency", str(self.warmup_prompts),
        ]  # fmt: skip

    def loads_for(self, runner: str) -> tuple[tuple[int, int], ...]:
        """(concurrency, number of prompts) pairs for a runner label of the GPU suite."""
        return self.loads if runner == "v2-graphs" else self.slow_loads
