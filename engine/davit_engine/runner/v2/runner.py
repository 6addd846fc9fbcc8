"""Runner V2: persistent request state on the GPU, inputs built by Triton kernels, sampling on
the GPU, CUDA graphs for decode, and a step that returns before the GPU finishes.

One step, all on the current stream:
1. release the slots of finished and preempted requests (host only);
2. stage the changes (new requests, appended blocks) and the row vectors, one pinned copy;
3. decode-only batches replay a captured graph (input preparation + forward + logits) padded to
   the next captured size; prefill and mixed batches run the same kernels eagerly;
4. the sampling kernel draws and writes each token into the state table, where the next step's
   input kernel reads it: the host never has to send generated tokens back;
5. the drawn tokens go to pinned memory with an event. `execute_async` returns here; the only
   synchronisation is `PendingStep.result()` waiting for that copy.
"""

from __future__ import annotations

import logging

import torch

from davit_contract.graphs import graph_batch_sizes
from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput, ScheduledRequest, SchedulerOutput
from davit_engine.kernels.attention_backend import NUM_KV_SPLITS_KEY, TritonPagedAttention
from davit_engine.kernels.input_prep import InputBuffers, prepare_inputs
from davit_engine.kernels.paged_attention import default_num_splits
from davit_engine.kernels.sampling import SamplingTable, sample
from davit_engine.layers.attention import AttentionMetadata
from davit_engine.loader import LoadedModel
from davit_engine.memory.profiler import size_kv_cache
from davit_engine.runner.paged_kv import (
    PROBE_TOP_K,
    PROBE_TOP_P,
    PagedKvRunner,
    allocate_kv_caches,
)
from davit_engine.runner.v2.fused_layers import install_fused_layers
from davit_engine.runner.v2.graph_probe import probe_v2_graphs
from davit_engine.runner.v2.graphs import DecodeGraphs
from davit_engine.runner.v2.pending import PendingStep
from davit_engine.runner.v2.sampler import sample_step
from davit_engine.runner.v2.state import RequestStateTable, StepRows
from davit_engine.runner.v2.step_probe import StepProbe, probe_v2_steps

logger = logging.getLogger(__name__)

_PENDING_BUFFERS = 4  # pinned output buffers; a fifth step in flight settles the oldest


class RunnerV2(PagedKvRunner):
    """See the module docstring. Same constructor as RunnerV1.

    Async contract: `execute_async(batch_n)` may be called before `result()` of step n-1 is
    read, as long as the scheduler produced `batch_n` without that result: V2 reads running
    requests' tokens from its device table, never from `ScheduledRequest.token_ids`, except
    for requests that (re)start with `is_new`, whose `token_ids` must then be complete.
    """

    name = "v2"
    supports_async_scheduling = True
    # Fused Triton layer kernels on CUDA (benchmarks switch this off to measure the difference).
    fuse_layers = True

    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device) -> None:
        super().__init__(config, loaded, device, TritonPagedAttention())
        self.use_graphs = device.type == "cuda" and not config.enforce_eager
        self.max_model_len = 0
        self.state: RequestStateTable | None = None
        self.inputs: InputBuffers | None = None
        self.graphs: DecodeGraphs | None = None
        self._out_buffers: list[torch.Tensor] = []
        self._out_owners: list[PendingStep | None] = []
        self._out_turn = 0
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.num_fused_layers = 0
        self.step_probe: StepProbe | None = None  # the memory probe's steps, once profiled
        if device.type == "cuda" and self.fuse_layers:
            self.num_fused_layers = install_fused_layers(self.model)

    # ---- KV cache sizing ----------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        """Measured by `davit_engine.memory`: real probe steps for the activation peak, CUDA
        graphs included; the profile and the probe steps are kept."""
        probe = None
        if self.use_graphs:

            def probe() -> tuple[int, int, tuple[int, ...]]:
                return probe_v2_graphs(self)

        self.memory_profile = size_kv_cache(
            self, self._dummy_prefill, self._probe_sampler, probe, self._probe_steps
        )
        return self.memory_profile.memory.num_blocks

    def _probe_steps(self) -> int:
        self.step_probe = probe_v2_steps(self)
        return self.step_probe.peak_bytes

    def _sample_probe_rows(self, logits: torch.Tensor) -> None:
        """On CUDA, the sampling kernel that steps use (the torch sampler elsewhere), with the
        logprobs' log-softmax when the engine allows logprobs."""
        if self.device.type != "cuda":
            super()._sample_probe_rows(logits)
            return
        rows, device = logits.shape[0], self.device
        table = SamplingTable(
            temperature=torch.ones(rows, dtype=torch.float32, device=device),
            top_k=torch.full((rows,), PROBE_TOP_K, dtype=torch.int32, device=device),
            top_p=torch.full((rows,), PROBE_TOP_P, dtype=torch.float32, device=device),
            min_p=torch.zeros(rows, dtype=torch.float32, device=device),
            seed=torch.zeros(rows, dtype=torch.int32, device=device),
        )
        slots = torch.arange(rows, dtype=torch.int32, device=device)
        if self.config.max_logprobs > 0:
            torch.log_softmax(logits, dim=-1)
        sample(logits, slots, slots, table)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        c = self.model_config
        config = self.config
        self.num_blocks = num_blocks
        # kv_caches[layer]: [2, num_blocks, block_size, Hkv, D]
        self.kv_caches = allocate_kv_caches(c, num_blocks, self.block_size, self.dtype, self.device)
        self.max_model_len = min(
            config.max_model_len or c.max_position_embeddings, num_blocks * self.block_size
        )
        max_blocks = -(-self.max_model_len // self.block_size)
        self.state = RequestStateTable(
            config.max_num_seqs, self.max_model_len, max_blocks, self.device, config.seed
        )
        self.inputs = InputBuffers(
            max(config.max_num_batched_tokens, config.max_num_seqs),
            config.max_num_seqs,
            max_blocks,
            self.device,
        )
        self._out_buffers = [
            torch.empty(
                config.max_num_seqs, dtype=torch.int64, pin_memory=self.device.type == "cuda"
            )
            for _ in range(_PENDING_BUFFERS)
        ]
        self._out_owners = [None] * _PENDING_BUFFERS
        logger.info(
            "runner V2: %d KV blocks x %d (%.2f GiB), %d slots, max_model_len %d",
            num_blocks,
            self.block_size,
            num_blocks * self.block_bytes / 2**30,
            config.max_num_seqs,
            self.max_model_len,
        )
        if self.use_graphs:
            self.graphs = DecodeGraphs(
                self._graph_step, graph_batch_sizes(config.max_num_seqs), c.vocab_size, self.device
            )
            with torch.inference_mode():
                self.graphs.capture()

    def release_kv_cache(self) -> None:
        """Drop the KV cache, request state, buffers and graphs, as before
        `initialize_kv_cache` (the memory probes allocate them for a probe cache first)."""
        self.graphs = None
        self.kv_caches = []
        self.state = None
        self.inputs = None
        self.num_blocks = 0
        self.max_model_len = 0
        self._out_buffers = []
        self._out_owners = []
        self._out_turn = 0

    # ---- one step -------------------------------------------------------------------------------

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        return self.execute_async(batch).result()

    def execute_async(self, batch: SchedulerOutput) -> PendingStep:
        """Launch one step; the returned handle's `result()` waits for its tokens."""
        state = self.state
        if state is None:
            raise RuntimeError("initialize_kv_cache() must run before execute()")
        state.release(batch.finished_ids)
        state.release(batch.preempted_ids)
        scheduled = batch.scheduled
        num_real = len(scheduled)
        pending = PendingStep(num_real, [r.needs_sample for r in scheduled])
        if not scheduled:
            return pending
        with torch.inference_mode():
            decode_only = all(r.num_new_tokens == 1 for r in scheduled)
            padded = self.graphs.padded_size(num_real) if self.graphs and decode_only else None
            rows = state.stage(batch, padded or num_real)
            max_seq_len = max(r.num_computed_tokens + r.num_new_tokens for r in scheduled)
            assert self.inputs is not None
            if padded is not None:
                assert self.graphs is not None
                logits = self.graphs.replay(padded)[:num_real]
                self.num_graph_steps += 1
            elif decode_only:
                logits = self._decode_logits(num_real, max_seq_len)
                self.num_eager_steps += 1
            else:
                logits = self._mixed_logits(rows, scheduled, max_seq_len)
                self.num_eager_steps += 1
            real = StepRows(
                slot=rows.slot[:num_real],
                num_computed=rows.num_computed[:num_real],
                num_new=rows.num_new[:num_real],
                needs_sample=rows.needs_sample[:num_real],
            )
            tokens, logprobs = sample_step(
                logits,
                real,
                self.inputs.seq_lens[:num_real],
                scheduled,
                state,
                self.model_config.eos_token_ids,
                max_seq_len,
            )
            turn = self._out_turn
            self._out_turn = (turn + 1) % len(self._out_buffers)
            previous = self._out_owners[turn]
            if previous is not None:
                previous.result()  # more steps in flight than buffers: settle the oldest first
            self._out_owners[turn] = pending
            host = self._out_buffers[turn]
            host[:num_real].copy_(tokens, non_blocking=True)
            pending.host_tokens = host
            pending.logprobs = logprobs
            if self.device.type == "cuda":
                pending.event = torch.cuda.Event()
                pending.event.record()
        return pending

    def _decode_logits(self, num_rows: int, max_seq_len: int) -> torch.Tensor:
        """Input preparation, forward and logits for `num_rows` one-token rows: [num_rows, V]."""
        return self.model.compute_logits(self._decode_hidden(num_rows, max_seq_len))

    def _graph_step(self, num_rows: int, out: torch.Tensor) -> None:
        """The captured decode step: its logits go into `out` ([num_rows, V] float32, rows of
        the graphs' shared buffer)."""
        hidden = self._decode_hidden(num_rows)  # [B, hidden]
        # compute_logits is lm_head then a float32 conversion: the copy converts while it
        # writes the shared buffer, one pass over the logits instead of two.
        out.copy_(self.model.lm_head(hidden))

    def _decode_hidden(self, num_rows: int, max_seq_len: int | None = None) -> torch.Tensor:
        """Input preparation and forward for `num_rows` one-token rows: [num_rows, hidden].

        With `max_seq_len=None` (graph capture) the launch shapes depend on `num_rows` alone.
        """
        state, inputs = self.state, self.inputs
        assert state is not None and inputs is not None
        rows = state.rows[:, :num_rows]
        step = prepare_inputs(
            rows[0],
            rows[1],
            rows[2],
            state.token_ids,
            state.block_table,
            inputs,
            num_rows,
            self.block_size,
        )
        horizon = max_seq_len if max_seq_len is not None else self.max_model_len
        meta = AttentionMetadata(
            slot_mapping=step.slot_mapping,
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables,
            max_query_len=1,
            max_seq_len=horizon,
            backend=self.backend,
        )
        meta.scratch[NUM_KV_SPLITS_KEY] = default_num_splits(
            num_rows, self.model_config.num_kv_heads, horizon
        )
        return self.model(step.input_ids, step.positions, self.kv_caches, meta)  # [B, hidden]

    def _mixed_logits(
        self, rows: StepRows, scheduled: list[ScheduledRequest], max_seq_len: int
    ) -> torch.Tensor:
        state, inputs = self.state, self.inputs
        assert state is not None and inputs is not None
        num_tokens = sum(r.num_new_tokens for r in scheduled)
        step = prepare_inputs(
            rows.slot,
            rows.num_computed,
            rows.num_new,
            state.token_ids,
            state.block_table,
            inputs,
            num_tokens,
            self.block_size,
        )
        meta = AttentionMetadata(
            slot_mapping=step.slot_mapping,
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables,
            max_query_len=max(r.num_new_tokens for r in scheduled),
            max_seq_len=max_seq_len,
            backend=self.backend,
        )
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)  # [T, hidden]
        return self.model.compute_logits(hidden[step.logits_index])  # [B, V]

    def shutdown(self) -> None:
        self.graphs = None
        self.kv_caches = []
        self.state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
