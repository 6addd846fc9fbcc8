"""Runner V1: inputs prepared on the CPU each step, plain-torch paged attention, torch sampler.

The simple, portable path: it runs on the CPU and on CUDA, and it runs features runner V2
refuses (custom logits processors). Each `execute()` builds the flat token batch from the
scheduler's plain data, runs one forward over all scheduled tokens (prefill chunks and decodes
mixed), computes logits only for rows that sample, and samples.

Under tensor parallelism every rank holds a runner V1 over its part of the model: rank 0's
`execute()` also sends each step's inputs to the others (runner/step_channel.py), whose
`follow()` loop runs the same forward; rank 0 alone samples.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput, ScheduledRequest, SchedulerOutput
from davit_engine.layers.attention import AttentionMetadata, TorchPagedAttention
from davit_engine.layers.cpu_linear import can_prepack, prepack_linears
from davit_engine.loader import LoadedModel
from davit_engine.memory.profiler import CPU_KV_CAP_BYTES, size_kv_cache, with_num_blocks
from davit_engine.runner.paged_kv import PagedKvRunner, allocate_kv_caches
from davit_engine.runner.sampler import Sampler
from davit_engine.runner.step_channel import Command, StepChannel, StepInputs
from davit_engine.types import TokenLogprob

logger = logging.getLogger(__name__)

# The KV cap on the CPU when nothing is specified (see davit_engine.memory.profiler).
CPU_KV_BUDGET_BYTES = CPU_KV_CAP_BYTES


class RunnerV1(PagedKvRunner):
    name = "v1"
    # Inputs are rebuilt from the batch every step: a failed step can run again (in parts).
    repeatable_steps = True

    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device) -> None:
        super().__init__(config, loaded, device, TorchPagedAttention())
        if can_prepack(self.dtype, device):
            with torch.no_grad():
                count = prepack_linears(self.model, batch_hint=config.max_num_seqs)
            logger.info("pre-packed %d linear layers for oneDNN (%s on CPU)", count, self.dtype)
        self.sampler = Sampler(loaded.config.eos_token_ids)
        # Tokens run through the model so far (prefix-cache hits are not among them).
        self.num_computed_tokens_total = 0
        self.tensor_parallel = loaded.tensor_parallel
        self.channel: StepChannel | None = None
        if self.tensor_parallel is not None:
            self.channel = StepChannel(self.tensor_parallel, device, self.backend)

    # ---- KV cache sizing ----------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        """Measured by `davit_engine.memory` (RSS on the CPU); the profile is kept."""
        self.memory_profile = size_kv_cache(self, self._dummy_prefill, self._probe_sampler)
        num_blocks = self.memory_profile.memory.num_blocks
        if self.tensor_parallel is not None:
            # Every rank sized its own memory; all of them hold the same number of blocks.
            num_blocks = self.tensor_parallel.min_over_ranks(num_blocks)
            if num_blocks != self.memory_profile.memory.num_blocks:
                self.memory_profile = with_num_blocks(self.memory_profile, num_blocks)
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        c = self.model_config
        self.num_blocks = num_blocks
        # kv_caches[layer]: [2, num_blocks, block_size, Hkv, D]
        self.kv_caches = allocate_kv_caches(
            c, num_blocks, self.block_size, self.kv_dtype, self.device
        )
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB, %s)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_bytes / 2**30,
            self.kv_dtype,
        )

    # ---- one step -------------------------------------------------------------------------------

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        scheduled = batch.scheduled
        if not scheduled:
            return RunnerOutput(sampled_token_ids=[])
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must run before execute()")
        input_ids, positions, meta, sample_rows = self._prepare_inputs(scheduled)
        with torch.inference_mode():
            if self.channel is not None:
                last = meta.query_start_loc[1:].to(torch.int64) - 1
                index = last[torch.tensor(sample_rows, dtype=torch.int64, device=self.device)]
                self.channel.send_step(StepInputs(input_ids, positions, meta, index))
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
            sampled: list[int | None] = [None] * len(scheduled)
            logprobs: list[TokenLogprob | None] = [None] * len(scheduled)
            if sample_rows:
                # Only the last token of each sampling request needs logits: [S, V].
                last = meta.query_start_loc[1:].to(torch.int64) - 1
                rows = torch.tensor(sample_rows, device=self.device)
                logits = self.model.compute_logits(hidden[last[rows]])
                tokens, row_logprobs = self.sampler.sample(
                    logits, [scheduled[i] for i in sample_rows]
                )
                for j, i in enumerate(sample_rows):
                    sampled[i] = tokens[j]
                    logprobs[i] = row_logprobs[j]
        self.num_computed_tokens_total += int(input_ids.shape[0])
        wants_logprobs = any(lp is not None for lp in logprobs)
        return RunnerOutput(
            sampled_token_ids=sampled, logprobs=logprobs if wants_logprobs else None
        )

    def follow(self) -> None:
        """A follower rank's loop (tensor parallelism, ranks above 0): allocate the KV cache
        and run the steps rank 0 sends, until it sends SHUTDOWN."""
        assert self.channel is not None, "follow() is for tensor-parallel ranks"
        while True:
            command, argument, step = self.channel.receive()
            if command == Command.SHUTDOWN:
                return
            if command == Command.INIT_KV_CACHE:
                self.initialize_kv_cache(argument)
                continue
            assert step is not None
            with torch.inference_mode():
                hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
                if step.logits_index.numel():
                    self.model.compute_logits(hidden[step.logits_index])  # sent to rank 0
            self.num_computed_tokens_total += int(step.input_ids.shape[0])

    def _prepare_inputs(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        block_size = self.block_size
        num_reqs = len(scheduled)
        query_lens = np.fromiter((r.num_new_tokens for r in scheduled), np.int64, num_reqs)
        starts = np.fromiter((r.num_computed_tokens for r in scheduled), np.int64, num_reqs)
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        max_blocks = max(len(r.block_ids) for r in scheduled)
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        for i, r in enumerate(scheduled):
            block_tables[i, : len(r.block_ids)] = r.block_ids
            start = r.num_computed_tokens
            input_ids[query_start_loc[i] : query_start_loc[i + 1]] = r.token_ids[
                start : start + r.num_new_tokens
            ]
        # positions [T]: each token's absolute position within its request.
        request_of_token = np.repeat(np.arange(num_reqs), query_lens)
        positions = (
            np.arange(num_tokens) - query_start_loc[request_of_token] + starts[request_of_token]
        )
        slot_mapping = (
            block_tables[request_of_token, positions // block_size] * block_size
            + positions % block_size
        )
        sample_rows = [i for i, r in enumerate(scheduled) if r.needs_sample]
        device = self.device

        def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(array).to(device=device, dtype=dtype)

        meta = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, torch.int64),
            query_start_loc=to_device(query_start_loc, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            block_tables=to_device(block_tables, torch.int32),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            backend=self.backend,
        )
        return (
            to_device(input_ids, torch.int64),
            to_device(positions, torch.int64),
            meta,
            sample_rows,
        )

    def shutdown(self) -> None:
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
