"""The paged KV-cache tensors and the memory probes (dummy prefill, sampler) that the memory
profiler runs; shared by runners."""

from __future__ import annotations

import torch

from davit_contract.profile import MemoryProfile
from davit_engine.config import EngineConfig
from davit_engine.core.batch import ScheduledRequest
from davit_engine.layers.attention import AttentionBackend, AttentionMetadata
from davit_engine.loader import LoadedModel, ModelConfig
from davit_engine.models.llama import LlamaForCausalLM
from davit_engine.runner.base import ModelRunner
from davit_engine.runner.sampler import Sampler
from davit_engine.types import SamplingParams

# Sampling of the memory probes' requests: the filtered (whole-row search) path.
PROBE_TOP_K = 50
PROBE_TOP_P = 0.9


def allocate_kv_caches(
    c: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed tensor per layer: [2, num_blocks, block_size, Hkv, D] (keys [0], values [1]).

    The layers are consecutive views of one [num_layers, 2, num_blocks, ...] tensor, so the KV
    offload tiers copy a block of every layer with one gather (davit_engine.offload).
    """
    whole = torch.zeros(
        c.num_layers,
        2,
        num_blocks,
        block_size,
        c.num_kv_heads,
        c.head_dim,
        dtype=dtype,
        device=device,
    )
    return list(whole.unbind(0))


def dummy_prefill(
    model: LlamaForCausalLM,
    c: ModelConfig,
    backend: AttentionBackend,
    num_tokens: int,
    num_logit_rows: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """One prefill of `num_tokens` into a private cache, then logits for the last rows: the
    activation peak a real step of that size reaches."""
    num_tokens = max(1, min(num_tokens, c.max_position_embeddings))
    num_blocks = -(-num_tokens // block_size)
    caches = allocate_kv_caches(c, num_blocks, block_size, dtype, device)
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        backend=backend,
    )
    with torch.inference_mode():
        hidden = model(torch.zeros_like(positions), positions, caches, meta)
        model.compute_logits(hidden[-min(num_tokens, num_logit_rows) :])


class PagedKvRunner(ModelRunner):
    """What runner V1 and runner V2 share about their paged KV cache: the loaded model and its
    attention backend, the size of one block, and the dummy prefill and sampler probe the
    memory profiler measures."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.model: LlamaForCausalLM = loaded.model
        # One rank's heads under tensor parallelism: the KV cache holds those only.
        self.model_config: ModelConfig = loaded.rank_config
        self.device = device
        self.dtype = loaded.dtype
        self.kv_dtype = loaded.kv_storage_dtype  # the model dtype, or FP8 (--kv-cache-dtype)
        self.block_size = config.block_size
        self.backend = backend
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.memory_profile: MemoryProfile | None = None  # once the KV cache was sized

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers (keys and values)."""
        c = self.model_config
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * element

    def _dummy_prefill(self, num_tokens: int) -> None:
        dummy_prefill(
            self.model,
            self.model_config,
            self.backend,
            num_tokens,
            self.config.max_num_seqs,
            self.block_size,
            self.kv_dtype,
            self.device,
        )

    def _probe_sampler(self) -> None:
        """The sampler over `max_num_seqs` rows of random logits with top-k and top-p on (and
        logprobs when allowed): the sampling share of the activation peak."""
        rows, vocab = self.config.max_num_seqs, self.model_config.vocab_size
        logits = torch.randn(rows, vocab, dtype=torch.float32, device=self.device)  # [B, V]
        with torch.inference_mode():
            self._sample_probe_rows(logits)

    def _sample_probe_rows(self, logits: torch.Tensor) -> None:
        """Sample `logits` [B, V] as the probe does; here with the torch sampler (runner V1's
        own, or one like it)."""
        sampler = getattr(self, "sampler", None) or Sampler(self.model_config.eos_token_ids)
        params = SamplingParams(
            top_k=PROBE_TOP_K,
            top_p=PROBE_TOP_P,
            logprobs=min(self.config.max_logprobs, 20) or None,
        )
        requests = [
            ScheduledRequest(f"probe-{i}", [0], 1, 0, 1, [], params, True)
            for i in range(logits.shape[0])
        ]
        sampler.sample(logits, requests)
