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

Speculative decoding (`speculative.py`): a step with verifying rows proposes the draft model's
drafts first (n-gram drafts arrive with the staged changes), computes logits at every position
of the verifying rows (a captured graph when every row verifies), verifies them, and samples
the other rows as above. With a draft model, every target forward is mirrored by the draft on
the same inputs (`draft_model.py`), so its KV cache follows the target's block tables.
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
from davit_engine.layers.fp8 import is_fp8
from davit_engine.loader import LoadedModel
from davit_engine.memory.profiler import size_kv_cache
from davit_engine.runner.paged_kv import (
    PROBE_TOP_K,
    PROBE_TOP_P,
    PagedKvRunner,
    allocate_kv_caches,
)
from davit_engine.runner.v2.draft_model import DraftModel, load_draft_model
from davit_engine.runner.v2.fused_layers import install_fused_layers
from davit_engine.runner.v2.graph_probe import probe_v2_graphs
from davit_engine.runner.v2.graphs import DecodeGraphs
from davit_engine.runner.v2.pending import PendingStep
from davit_engine.runner.v2.sampler import LogprobRequest, indices, sample_step
from davit_engine.runner.v2.speculative import SpecDecoder
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
    # A restated row (`is_new`) rebuilds its request's slot (tokens, blocks, parameters) from
    # the host, so a failed step can run again, in parts (see isolating_runner).
    repeatable_steps = True
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
        self.spec: SpecDecoder | None = None
        self.draft: DraftModel | None = None
        self._spec_buffers: list[torch.Tensor] = []
        spec = config.speculative_config
        if spec is not None:
            self.spec = SpecDecoder(
                spec, config.max_num_seqs, config.max_num_batched_tokens, draft=None
            )
            if spec.method == "draft_model":
                assert spec.model is not None
                draft_loaded = load_draft_model(config, spec.model, loaded, device)
                if device.type == "cuda" and self.fuse_layers:
                    install_fused_layers(draft_loaded.model)
                self.draft = DraftModel(
                    draft_loaded,
                    TritonPagedAttention(),
                    self.block_size,
                    spec.num_speculative_tokens,
                    self.spec.max_rows,
                    device,
                )
                self.spec.draft = self.draft
            log = logger.warning if spec.is_lossy else logger.info
            log("speculative decoding: %s", spec.describe())

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers, the draft model's included."""
        draft = self.draft.block_bytes if self.draft is not None else 0
        return super().block_bytes + draft

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
        self.kv_caches = allocate_kv_caches(
            c, num_blocks, self.block_size, self.kv_dtype, self.device
        )
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
        if self.spec is not None:
            # per verifying row: K + 1 tokens, then the number accepted
            self._spec_buffers = [
                torch.empty(
                    self.spec.max_rows,
                    self.spec.k + 2,
                    dtype=torch.int64,
                    pin_memory=self.device.type == "cuda",
                )
                for _ in range(_PENDING_BUFFERS)
            ]
        if self.draft is not None:
            self.draft.allocate(num_blocks, self.state, max_blocks, self.max_model_len)
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
            spec_graphs = self.make_spec_graphs()
            with torch.inference_mode():
                self.graphs.capture()
                for graphs in spec_graphs:
                    graphs.capture()

    def make_spec_graphs(self) -> list[DecodeGraphs]:
        """Speculative decoding's graphs (verification, the draft's proposal), installed but
        not captured yet; none without speculative decoding."""
        if self.spec is None:
            return []
        sizes = graph_batch_sizes(self.spec.max_rows)
        self.spec.graphs = DecodeGraphs(
            self._verify_graph_step,
            sizes,
            self.model_config.vocab_size,
            self.device,
            tokens_per_row=self.spec.k + 1,
            name="verification",
        )
        made = [self.spec.graphs]
        if self.draft is not None:
            self.draft.graphs = self.draft.make_graphs(sizes)
            made.append(self.draft.graphs)
        return made

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
        self._spec_buffers = []
        self._out_turn = 0
        if self.spec is not None:
            self.spec.graphs = None
        if self.draft is not None:
            self.draft.release()

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
        spec_out: torch.Tensor | None = None
        with torch.inference_mode():
            if self.spec is not None and any(r.num_spec_tokens for r in scheduled):
                tokens, logprobs, spec_out, pending.spec_rows = self._verification_step(batch)
            else:
                tokens, logprobs = self._plain_step(batch)
            turn = self._out_turn
            self._out_turn = (turn + 1) % len(self._out_buffers)
            previous = self._out_owners[turn]
            if previous is not None:
                # More steps in flight than buffers: the oldest keeps its tokens elsewhere.
                previous.keep_tokens()
            self._out_owners[turn] = pending
            host = self._out_buffers[turn]
            host[:num_real].copy_(tokens, non_blocking=True)
            pending.host_tokens = host
            pending.logprobs = logprobs
            if spec_out is not None:
                host_spec = self._spec_buffers[turn]
                host_spec[: spec_out.shape[0]].copy_(spec_out, non_blocking=True)
                pending.host_spec = host_spec
            if self.device.type == "cuda":
                pending.event = torch.cuda.Event()
                pending.event.record()
        return pending

    def _plain_step(self, batch: SchedulerOutput) -> tuple[torch.Tensor, LogprobRequest | None]:
        """A step without verification: forward, logits of each row's last token, sampling."""
        state = self.state
        assert state is not None and self.inputs is not None
        scheduled = batch.scheduled
        num_real = len(scheduled)
        decode_only = all(r.num_new_tokens == 1 for r in scheduled)
        padded = self.graphs.padded_size(num_real) if self.graphs and decode_only else None
        rows = state.stage(batch, padded or num_real)
        max_seq_len = max(r.num_computed_tokens + r.num_new_tokens for r in scheduled)
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
        return sample_step(
            logits,
            _first_rows(rows, num_real),
            self.inputs.seq_lens[:num_real],
            scheduled,
            state,
            self.model_config.eos_token_ids,
            max_seq_len,
        )

    def _verification_step(
        self, batch: SchedulerOutput
    ) -> tuple[torch.Tensor, LogprobRequest | None, torch.Tensor, list[int]]:
        """A step with verifying rows: (tokens of the other rows [B], their logprobs, the
        verdicts [S, K + 2] (K + 1 tokens, then the number accepted), the verifying rows)."""
        state, spec = self.state, self.spec
        assert state is not None and spec is not None and self.inputs is not None
        scheduled = batch.scheduled
        num_real = len(scheduled)
        k = spec.k
        spec_rows = [i for i, r in enumerate(scheduled) if r.num_spec_tokens]
        plain_rows = [i for i, r in enumerate(scheduled) if not r.num_spec_tokens]
        if any(scheduled[i].num_spec_tokens != k for i in spec_rows):
            raise ValueError(f"runner V2 verifies exactly {k} draft positions per row")
        num_spec = len(spec_rows)
        if num_spec > spec.max_rows:
            raise ValueError(f"{num_spec} verifying rows exceed the cap of {spec.max_rows}")
        device = self.device
        uniform = not plain_rows
        padded = spec.graphs.padded_size(num_real) if spec.graphs is not None and uniform else None
        rows = state.stage(batch, padded or num_real, pad_num_new=k + 1 if padded else 1)
        max_seq_len = max(r.num_computed_tokens + r.num_new_tokens for r in scheduled)
        spec_index = (
            torch.arange(num_spec, device=device) if uniform else indices(spec_rows, device)
        )
        if self.draft is not None:
            draft_padded = None
            if self.draft.graphs is not None:
                draft_padded = self.draft.graphs.padded_size(num_spec)
            self.draft.propose(
                rows.slot[spec_index],
                rows.num_computed[spec_index],
                num_spec,
                max_seq_len - k,
                draft_padded,
            )
        vocab = self.model_config.vocab_size
        if padded is not None:
            assert spec.graphs is not None
            all_logits = spec.graphs.replay(padded)[: num_real * (k + 1)]
            spec_logits = all_logits.view(num_real, k + 1, vocab)
            plain_logits = None
            spec.num_verify_graph_steps += 1
            self.num_graph_steps += 1
        else:
            starts, offset = [], 0
            for r in scheduled:
                starts.append(offset)
                offset += r.num_new_tokens
            wanted = [starts[i] + j for i in spec_rows for j in range(k + 1)]
            wanted += [starts[i] + scheduled[i].num_new_tokens - 1 for i in plain_rows]
            hidden = self._mixed_hidden(rows, scheduled, max_seq_len)
            logits = self.model.compute_logits(hidden[indices(wanted, device)])
            spec_logits = logits[: num_spec * (k + 1)].view(num_spec, k + 1, vocab)
            plain_logits = logits[num_spec * (k + 1) :]
            self.num_eager_steps += 1
        verdicts = spec.verify(
            spec_logits, rows, spec_index, [scheduled[i] for i in spec_rows], state
        )
        tokens = torch.zeros(num_real, dtype=torch.int64, device=device)
        logprobs = None
        if plain_rows:
            assert plain_logits is not None
            plain_index = indices(plain_rows, device)
            plain = StepRows(
                slot=rows.slot[plain_index],
                num_computed=rows.num_computed[plain_index],
                num_new=rows.num_new[plain_index],
                needs_sample=rows.needs_sample[plain_index],
            )
            plain_tokens, logprobs = sample_step(
                plain_logits,
                plain,
                self.inputs.seq_lens[plain_index],
                [scheduled[i] for i in plain_rows],
                state,
                self.model_config.eos_token_ids,
                max_seq_len,
            )
            tokens.index_copy_(0, plain_index, plain_tokens)
            if logprobs is not None:
                logprobs.rows = [plain_rows[j] for j in logprobs.rows]
        spec_out = torch.cat([verdicts.tokens, verdicts.num_accepted[:, None]], dim=1)
        return tokens, logprobs, spec_out, spec_rows

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

    def _verify_graph_step(self, num_rows: int, out: torch.Tensor) -> None:
        """The captured verification step: `num_rows` rows of K + 1 tokens each (the staged
        row vectors say so, padding rows included); the logits of every position go into
        `out` ([num_rows * (K + 1), V] float32)."""
        state, inputs, spec = self.state, self.inputs, self.spec
        assert state is not None and inputs is not None and spec is not None
        rows = state.rows[:, :num_rows]
        num_tokens = num_rows * (spec.k + 1)
        step = prepare_inputs(
            rows[0],
            rows[1],
            rows[2],
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
            max_query_len=spec.k + 1,
            max_seq_len=self.max_model_len,
            backend=self.backend,
        )
        # Split keys as decode does (fixed per captured size): without, one program per row and
        # KV head walks the whole context, and the step costs several decode steps.
        meta.scratch[NUM_KV_SPLITS_KEY] = default_num_splits(
            num_rows,
            self.model_config.num_kv_heads,
            self.max_model_len,
            self.device,
            fp8=is_fp8(self.kv_dtype),
        )
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)  # [T, hidden]
        if self.draft is not None:
            self.draft.mirror(step.input_ids, step.positions, meta, num_rows)
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
            num_rows,
            self.model_config.num_kv_heads,
            horizon,
            self.device,
            fp8=is_fp8(self.kv_dtype),
        )
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)  # [B, hidden]
        if self.draft is not None:
            self.draft.mirror(step.input_ids, step.positions, meta, num_rows)
        return hidden

    def _mixed_logits(
        self, rows: StepRows, scheduled: list[ScheduledRequest], max_seq_len: int
    ) -> torch.Tensor:
        """Logits of each row's last token: [B, V]."""
        hidden = self._mixed_hidden(rows, scheduled, max_seq_len)
        assert self.inputs is not None
        num_rows = len(scheduled)
        return self.model.compute_logits(hidden[self.inputs.logits_index[:num_rows]])  # [B, V]

    def _mixed_hidden(
        self, rows: StepRows, scheduled: list[ScheduledRequest], max_seq_len: int
    ) -> torch.Tensor:
        """Input preparation and forward of any mix of prefill chunks, decodes and
        verifications: [T, hidden]."""
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
        if self.draft is not None:
            self.draft.mirror(step.input_ids, step.positions, meta, len(scheduled))
        return hidden

    def shutdown(self) -> None:
        self.graphs = None
        self.kv_caches = []
        self.state = None
        if self.spec is not None:
            self.spec.graphs = None
        if self.draft is not None:
            self.draft.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _first_rows(rows: StepRows, num_rows: int) -> StepRows:
    return StepRows(
        slot=rows.slot[:num_rows],
        num_computed=rows.num_computed[:num_rows],
        num_new=rows.num_new[:num_rows],
        needs_sample=rows.needs_sample[:num_rows],
    )
