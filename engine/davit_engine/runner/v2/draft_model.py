"""The draft model of speculative decoding (`method: draft_model`): a smaller model with the
target's tokenizer, its own weights and its own paged KV cache.

Its KV cache is indexed by the target's block tables (same block ids, same block size; a block
holds the target's K/V in the target's cache and the draft's in this one), so the block manager
allocates, shares through the prefix cache and frees both at once: a request's blocks are
always the blocks of both models.

Two passes keep it in step with the target:
- the mirror pass: every target forward (prefill chunks, decodes, verification) is repeated by
  the draft on the same prepared inputs, so the draft has K/V wherever the target has;
- the proposal: before a verification step, K single-token decodes of the verifying rows, each
  reading its input token from the state table (the last token, then the draft's previous
  guess) and writing its argmax there, after the row's last token, where the target's input
  preparation picks the drafts up. The row positions advance on the device, so the K decodes
  replay one captured graph K times.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import cast

import torch

from davit_engine.config import DType, EngineConfig
from davit_engine.kernels.attention_backend import NUM_KV_SPLITS_KEY
from davit_engine.kernels.input_prep import InputBuffers, prepare_inputs
from davit_engine.kernels.paged_attention import default_num_splits
from davit_engine.layers.attention import AttentionBackend, AttentionMetadata
from davit_engine.loader import LoadedModel, ModelConfig, load_model
from davit_engine.models.llama import LlamaForCausalLM
from davit_engine.runner.paged_kv import allocate_kv_caches
from davit_engine.runner.v2.graphs import DecodeGraphs
from davit_engine.runner.v2.state import RequestStateTable
from davit_engine.spec_decode.config import FLAG
from davit_engine.types import ParamError

logger = logging.getLogger(__name__)


def load_draft_model(
    config: EngineConfig, draft_source: str, target: LoadedModel, device: torch.device
) -> LoadedModel:
    """Load the draft from `draft_source` (a directory, a GGUF file or random:<shape>) in the
    target's dtype; ParamError(FLAG) when it cannot serve as the target's draft."""
    dtype = cast(DType, str(target.dtype).removeprefix("torch."))
    draft_config = dataclasses.replace(
        config, model=draft_source, dtype=dtype, speculative_config=None
    )
    try:
        loaded = load_model(draft_config, device)
    except ParamError as exc:
        raise ParamError(FLAG, f"draft model {draft_source}: {exc.message}") from None
    if loaded.config.vocab_size != target.config.vocab_size:
        raise ParamError(
            FLAG,
            f"model {draft_source} has a vocabulary of {loaded.config.vocab_size} tokens, the "
            f"target {target.config.vocab_size}: a draft model must share the target's tokenizer",
        )
    max_len = config.max_model_len or target.config.max_position_embeddings
    if loaded.config.max_position_embeddings < max_len:
        raise ParamError(
            FLAG,
            f"model {draft_source} has {loaded.config.max_position_embeddings} positions, fewer "
            f"than max_model_len {max_len}: lower --max-model-len or pick another draft",
        )
    return loaded


class DraftModel:
    """The draft's weights, KV cache, proposal buffers and (on CUDA) proposal graphs."""

    def __init__(
        self,
        loaded: LoadedModel,
        backend: AttentionBackend,
        block_size: int,
        num_spec_tokens: int,
        max_rows: int,
        device: torch.device,
    ) -> None:
        self.loaded = loaded
        self.model: LlamaForCausalLM = loaded.model
        self.model_config: ModelConfig = loaded.config
        self.backend = backend
        self.block_size = block_size
        self.k = num_spec_tokens
        self.max_rows = max_rows
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.state: RequestStateTable | None = None
        self.inputs: InputBuffers | None = None
        self.graphs: DecodeGraphs | None = None
        # rows[0]: slot, rows[1]: position of the token fed next, rows[2]: 1 (tokens per row)
        self.rows = torch.zeros(3, max_rows, dtype=torch.int32, device=device)
        self.max_model_len = 0
        self.num_proposals = 0

    @property
    def block_bytes(self) -> int:
        c = self.model_config
        element = torch.empty((), dtype=self.loaded.dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * element

    def allocate(
        self, num_blocks: int, state: RequestStateTable, max_blocks: int, max_model_len: int
    ) -> None:
        """Allocate the draft's KV cache for the target's `num_blocks` and its proposal
        buffers; `state` is the target's request-state table (token ids and block tables)."""
        self.kv_caches = allocate_kv_caches(
            self.model_config, num_blocks, self.block_size, self.loaded.dtype, self.device
        )
        self.state = state
        self.max_model_len = max_model_len
        self.inputs = InputBuffers(self.max_rows, self.max_rows, max_blocks, self.device)
        self.rows.zero_()
        self.rows[0].fill_(state.pad_slot)
        self.rows[2].fill_(1)

    def release(self) -> None:
        self.graphs = None
        self.kv_caches = []
        self.state = None
        self.inputs = None

    def make_graphs(self, sizes: list[int]) -> DecodeGraphs:
        """The proposal step's graphs (not captured yet)."""
        return DecodeGraphs(
            self._propose_step, sizes, self.model_config.vocab_size, self.device, name="draft"
        )

    # ---- the mirror pass ------------------------------------------------------------------

    def mirror(
        self,
        input_ids: torch.Tensor,  # [T] int64, the target's prepared inputs
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        num_rows: int,
    ) -> None:
        """Run the draft over the target step's tokens, writing its own K/V (no logits)."""
        draft_meta = AttentionMetadata(
            slot_mapping=meta.slot_mapping,
            query_start_loc=meta.query_start_loc,
            seq_lens=meta.seq_lens,
            block_tables=meta.block_tables,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            backend=self.backend,
        )
        if NUM_KV_SPLITS_KEY in meta.scratch:  # a captured step: a fixed launch shape
            draft_meta.scratch[NUM_KV_SPLITS_KEY] = default_num_splits(
                num_rows, self.model_config.num_kv_heads, meta.max_seq_len, self.device
            )
        self.model(input_ids, positions, self.kv_caches, draft_meta)

    # ---- the proposal ---------------------------------------------------------------------

    def propose(
        self,
        slots: torch.Tensor,  # [S] int32: the verifying rows' slots
        last_positions: torch.Tensor,  # [S] int32: position of each row's last token
        num_rows: int,
        max_seq_len: int,
        padded: int | None,
    ) -> None:
        """Write K drafts after each row's last token in the state table (device only).

        `padded` is the captured graph size to replay (None: eager); padding rows sit on the
        padding slot, which has no KV block.
        """
        assert self.state is not None
        rows = self.rows
        width = padded or num_rows
        rows[0, :width].fill_(self.state.pad_slot)
        rows[1, :width].zero_()
        rows[0, :num_rows].copy_(slots)
        rows[1, :num_rows].copy_(last_positions)
        for j in range(self.k):
            if padded is not None:
                assert self.graphs is not None
                self.graphs.replay(padded)
            else:
                out = torch.empty(
                    num_rows, self.model_config.vocab_size, dtype=torch.float32, device=self.device
                )
                self._propose_step(num_rows, out, max_seq_len + j)
        self.num_proposals += 1

    def _propose_step(
        self, num_rows: int, out: torch.Tensor, max_seq_len: int | None = None
    ) -> None:
        """One draft decode of `num_rows` rows: feed the token at each row's position, write the
        argmax one position later, advance the positions. `max_seq_len=None`: graph capture
        (shapes depend on `num_rows` alone)."""
        state, inputs = self.state, self.inputs
        assert state is not None and inputs is not None
        rows = self.rows[:, :num_rows]
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
            num_rows, self.model_config.num_kv_heads, horizon, self.device
        )
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)  # [B, hidden]
        out.copy_(self.model.lm_head(hidden))
        drafts = out.argmax(-1)  # [B]
        width = state.token_ids.shape[1]
        target = (rows[1].long() + 1).clamp(max=width - 1)
        state.token_ids.view(-1).index_copy_(
            0, rows[0].long() * width + target, drafts.to(torch.int32)
        )
        rows[1] += 1
