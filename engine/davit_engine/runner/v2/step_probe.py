"""Runner V2's activation peak, measured over real steps against a probe KV cache.

A dummy forward and a separate sampler call measure each part alone; a real run keeps the
caching allocator's blocks of every size it has used side by side (the prefill chunk's
activations, `max_num_seqs` rows of float32 logits, the sampler's whole-row search, the
logprobs). So the probe runs the runner's own steps, `execute_async(...).result()` with input
preparation, forward, logits and sampling, over requests that reach the limits:

1. one request prefills a chunk of `max_num_batched_tokens` tokens;
2. its last chunk shares a step with `max_num_seqs - 1` one-token prompts: the step has
   `max_num_batched_tokens` tokens and samples `max_num_seqs` rows;
3. every request decodes one token (eager: the probe captures no graph).

Every request samples with top-k 50 and top-p 0.9 (the whole-row search path) and asks for
`max_logprobs` logprobs when the engine allows any. The real `Scheduler` turns the requests into
steps, so the shapes are those a run with the same limits produces (smaller limits, chunked
prefill off or a short `max_model_len` give fewer or smaller steps, never invalid ones).

The peak is the highest reserved memory (resident set on the CPU) during the steps above what
the probe KV cache and the runner's buffers hold; nothing is released between the steps, as in a
run. Everything is released afterwards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from davit_engine.core.scheduler import Scheduler
from davit_engine.memory.profiler import PeakWindow
from davit_engine.runner.paged_kv import PROBE_TOP_K, PROBE_TOP_P
from davit_engine.types import EngineRequest, SamplingParams

_MAX_OUTPUT_TOKENS = 2  # one sampled at the end of the prefill, one by the decode step


@dataclass(frozen=True)
class StepProbe:
    """What the probe ran and measured: one entry per step in the `*_per_step` fields."""

    peak_bytes: int
    num_blocks: int  # blocks of the probe KV cache
    tokens_per_step: tuple[int, ...]
    rows_per_step: tuple[int, ...]
    sampled_per_step: tuple[int, ...]  # rows that drew a token (the runner's output)


@dataclass(frozen=True)
class ProbeRequests:
    """Prompt lengths of the probe requests and the KV blocks they need together."""

    prompt_lens: tuple[int, ...]
    num_blocks: int


def plan_probe_requests(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int
) -> ProbeRequests:
    """Request 0 is one full chunk of `max_num_batched_tokens` plus the `rest` that, with
    `max_num_seqs - 1` one-token prompts, fills the second step's budget exactly. Every prompt
    leaves room for two output tokens within `max_model_len`."""
    rows = min(max_num_seqs, max_num_batched_tokens)
    rest = max(1, max_num_batched_tokens - (rows - 1))
    longest = max(1, max_model_len - _MAX_OUTPUT_TOKENS)
    first = min(max_num_batched_tokens + rest, longest)
    prompt_lens = (first, *([1] * (max_num_seqs - 1)))
    blocks = sum(-(-(n + _MAX_OUTPUT_TOKENS) // block_size) for n in prompt_lens)
    # The scheduler keeps 1% of the blocks back from admissions while requests run.
    blocks += -(-blocks // 100) + 1
    full_length = -(-max_model_len // block_size)  # the buffers are sized for max_model_len
    return ProbeRequests(prompt_lens, max(blocks, full_length))


def probe_v2_steps(runner: Any) -> StepProbe:
    """Run the probe steps through a RunnerV2 (weights loaded, no KV cache yet); returns their
    activation peak. Leaves the runner without a KV cache, as it found it."""
    config = runner.config
    device = runner.device
    max_len = config.max_model_len or runner.model_config.max_position_embeddings
    plan = plan_probe_requests(
        config.max_num_seqs, config.max_num_batched_tokens, max_len, config.block_size
    )
    vocab = runner.model_config.vocab_size
    logprobs = min(config.max_logprobs, vocab)
    params = SamplingParams(
        max_tokens=_MAX_OUTPUT_TOKENS,
        temperature=1.0,
        top_k=PROBE_TOP_K,
        top_p=PROBE_TOP_P,
        logprobs=logprobs if logprobs > 0 else None,
        ignore_eos=True,
    )
    # No prefix caching: identical probe prompts must all be computed.
    scheduler = Scheduler(
        dataclasses.replace(config, enable_prefix_caching=False, max_queue_len=None),
        plan.num_blocks,
        max_len,
    )
    for i, n in enumerate(plan.prompt_lens):
        prompt = [(i + j) % vocab for j in range(n)]
        scheduler.add_request(EngineRequest(f"memory-probe-{i}", prompt, params))

    use_graphs = runner.use_graphs
    runner.use_graphs = False  # eager steps; the graph pool is measured on its own
    tokens: list[int] = []
    rows: list[int] = []
    sampled: list[int] = []
    try:
        runner.initialize_kv_cache(plan.num_blocks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the allocation's temporaries are not the run's
        window = PeakWindow(device)
        window.start()
        while scheduler.has_unfinished():
            batch = scheduler.schedule()
            if batch.is_empty:
                raise RuntimeError("memory probe: the scheduler stalled with requests left")
            result = runner.execute_async(batch).result()
            tokens.append(batch.num_batched_tokens)
            rows.append(len(batch.scheduled))
            sampled.append(sum(t is not None for t in result.sampled_token_ids))
            scheduler.update_from_output(batch, result)
        peak = window.peak_bytes()
    finally:
        runner.use_graphs = use_graphs
        runner.release_kv_cache()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    return StepProbe(peak, plan.num_blocks, tuple(tokens), tuple(rows), tuple(sampled))
