"""Tensor parallelism applied to the Llama family after the single-device model is built.

One rank holds (shapes per rank, `N` ranks):
- attention: `num_heads / N` query heads and `num_kv_heads / N` KV heads: the fused QKV
  projection is column-parallel (each of q, k and v split by heads), `o_proj` row-parallel;
  the KV cache holds the rank's KV heads only;
- MLP: `intermediate_size / N` columns of gate and of up (column-parallel `gate_up_proj`),
  `down_proj` row-parallel;
- the embedding and the LM head split by vocabulary rows (layers/parallel.py);
- norms (q/k norms included) whole.

The rank's model is `LlamaForCausalLM(rank_config(...))` with the vocabulary modules swapped in
and an all-reduce after each attention and MLP block. Checkpoints stay whole: `shard_weights`
cuts each tensor to the rank's part as it streams past, so `load_weights` sees exactly the
rank's shapes. Which dimension each tensor splits along is declared below as data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from davit_engine.layers.parallel import (
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    reduce_output_hook,
    rows_per_rank,
)
from davit_engine.models.config import ModelConfig
from davit_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from davit_engine.types import ParamError

FLAG = "--tensor-parallel-size"

# Checkpoint (Hugging Face) name suffixes split by output rows: column-parallel.
COLUMN_SUFFIXES: tuple[str, ...] = (
    ".q_proj.weight",
    ".q_proj.bias",
    ".k_proj.weight",
    ".k_proj.bias",
    ".v_proj.weight",
    ".v_proj.bias",
    ".gate_proj.weight",
    ".up_proj.weight",
)
# FP8 projections' channel scales (one per output row) follow their rows; one scale for a
# whole projection, and a row-parallel projection's scales (its output rows are whole on every
# rank), stay whole.
COLUMN_SCALE_SUFFIXES: tuple[str, ...] = tuple(
    suffix + "_scale" for suffix in COLUMN_SUFFIXES if suffix.endswith(".weight")
)
# Split by input columns: row-parallel (their outputs are partial sums, all-reduced).
ROW_SUFFIXES: tuple[str, ...] = (".o_proj.weight", ".down_proj.weight")
# Their FP8 scales per row and group of input columns (block-wise checkpoints served with their
# own scales, quant/fp8_block_linear.py) follow the columns; the loader has checked that every
# rank's columns hold whole groups. Per-channel or per-tensor scales stay whole.
ROW_SCALE_SUFFIXES: tuple[str, ...] = tuple(suffix + "_scale" for suffix in ROW_SUFFIXES)
# Split by vocabulary rows, padded to a multiple of the rank count.
VOCAB_NAMES: tuple[str, ...] = ("model.embed_tokens.weight", "lm_head.weight")


def rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """`config` with one rank's heads and MLP columns (vocabulary and hidden size whole).

    Raises ParamError naming --tensor-parallel-size when `size` does not divide the attention
    heads, the KV heads or the MLP width.
    """
    if size < 1:
        raise ParamError(FLAG, f"must be at least 1, got {size}")
    for what, count in (
        ("attention heads", config.num_heads),
        ("KV heads", config.num_kv_heads),
        ("MLP intermediate size", config.intermediate_size),
    ):
        if count % size != 0:
            divisors = [d for d in range(1, config.num_kv_heads + 1) if _divides_all(config, d)]
            raise ParamError(
                FLAG,
                f"{size} does not divide the model's {count} {what}; sizes that divide its "
                f"{config.num_heads} attention heads, {config.num_kv_heads} KV heads and "
                f"{config.intermediate_size} MLP columns: {', '.join(map(str, divisors))}",
            )
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=config.num_kv_heads // size,
        intermediate_size=config.intermediate_size // size,
    )


def _divides_all(config: ModelConfig, d: int) -> bool:
    return all(
        n % d == 0 for n in (config.num_heads, config.num_kv_heads, config.intermediate_size)
    )


def parallelize(model: LlamaForCausalLM, full: ModelConfig, tp: TensorParallel) -> None:
    """Make `model` (built from `rank_config(full, tp.size)`, typically on the meta device) one
    rank of a tensor-parallel model: vocabulary-parallel embedding and LM head, an all-reduce
    after every attention and MLP block. New parameters are created on the current default
    device and dtype, like the model's own."""
    hidden = full.hidden_size
    model.model.embed_tokens = VocabParallelEmbedding(full.vocab_size, hidden, tp)  # type: ignore[assignment]
    model.lm_head = VocabParallelLMHead(full.vocab_size, hidden, tp)  # type: ignore[assignment]
    if full.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    hook = reduce_output_hook(tp)
    for module in model.modules():
        if isinstance(module, LlamaAttention | LlamaMLP):
            module.register_forward_hook(hook)


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], full: ModelConfig, tp: TensorParallel
) -> Iterator[tuple[str, torch.Tensor]]:
    """The rank's part of each checkpoint tensor (names unchanged; other tensors whole). FP8
    weights come with one scale per output channel or per projection, or one per output row and
    group of input columns (block scales are converted to one of those before the stream gets
    here)."""
    for name, tensor in weights:
        if name.endswith(COLUMN_SUFFIXES) or (
            name.endswith(COLUMN_SCALE_SUFFIXES) and tensor.numel() > 1
        ):
            yield name, _split(tensor, 0, tp)
        elif name.endswith(ROW_SUFFIXES) or (
            name.endswith(ROW_SCALE_SUFFIXES) and tensor.dim() == 2 and tensor.shape[1] > 1
        ):
            yield name, _split(tensor, 1, tp)
        elif name in VOCAB_NAMES:
            yield name, _vocab_rows(tensor, full.vocab_size, tp)
        else:
            yield name, tensor


def _split(tensor: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    if tensor.shape[dim] % tp.size != 0:
        raise ParamError(
            FLAG,
            f"a checkpoint tensor of shape {tuple(tensor.shape)} cannot be split {tp.size} ways "
            f"along dimension {dim}",
        )
    return tensor.chunk(tp.size, dim=dim)[tp.rank]


def _vocab_rows(tensor: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    if tensor.shape[0] != vocab_size:
        raise ParamError(
            "model",
            f"a vocabulary tensor has {tensor.shape[0]} rows, the model config says "
            f"vocab_size {vocab_size}",
        )
    n = rows_per_rank(vocab_size, tp.size)
    part = tensor[tp.rank * n : (tp.rank + 1) * n]
    if part.shape[0] == n:
        return part
    padded = tensor.new_zeros((n, *tensor.shape[1:]))  # the last rank's rows past the vocab
    padded[: part.shape[0]] = part
    return padded
