"""Tensor-parallel sharding of the Llama family, without processes: per-rank shapes, the
refusal of sizes that do not divide the heads, the checkpoint cuts, and the random-weight
stream that ranks cut from. The forward across processes is tested in test_tensor_parallel.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from davit_engine.layers.parallel import TensorParallel, rows_per_rank
from davit_engine.loader import build_empty
from davit_engine.loader.random_weights import fill_random, iter_random_weights
from davit_engine.models.config import ModelConfig
from davit_engine.models.llama import LlamaForCausalLM
from davit_engine.models.parallel import rank_config, shard_weights
from davit_engine.shapes import get_shape
from davit_engine.types import ParamError

CPU = torch.device("cpu")


def test_rank_config_splits_heads_and_mlp_columns() -> None:
    c = get_shape("qwen3-tiny")  # 4 heads, 2 KV heads, 128 MLP columns
    r = rank_config(c, 2)
    assert (r.num_heads, r.num_kv_heads, r.intermediate_size) == (2, 1, 64)
    assert (r.vocab_size, r.hidden_size, r.head_dim) == (c.vocab_size, c.hidden_size, c.head_dim)


@pytest.mark.parametrize(
    ("shape", "size", "what"),
    [
        ("qwen2-tiny", 2, "1 KV heads"),  # one KV head cannot be split
        ("smollm2-135m", 2, "9 attention heads"),
        ("qwen3-tiny", 3, "4 attention heads"),
    ],
)
def test_sizes_that_do_not_divide_the_heads_are_refused(shape: str, size: int, what: str) -> None:
    with pytest.raises(ParamError) as info:
        rank_config(get_shape(shape), size)
    assert info.value.param == "--tensor-parallel-size"
    assert what in info.value.message
    assert "sizes that divide" in info.value.message


def test_smollm2_names_the_sizes_it_accepts() -> None:
    with pytest.raises(ParamError, match=r"divides? .*: 1, 3$"):
        rank_config(get_shape("smollm2-135m"), 2)


def _whole_model(config: ModelConfig, seed: int) -> LlamaForCausalLM:
    model = build_empty(config, torch.float32, CPU)
    fill_random(model, seed)
    return model


def test_random_weight_stream_equals_fill_random() -> None:
    """A rank cuts its part from `iter_random_weights`: loaded whole, it is `fill_random`."""
    config = get_shape("qwen3-tiny")
    expected = _whole_model(config, seed=3)
    streamed = build_empty(config, torch.float32, CPU)
    with torch.no_grad():
        streamed.load_weights(iter_random_weights(config, 3, CPU), "random")
    for (name, a), (_, b) in zip(
        expected.state_dict().items(), streamed.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("shape", ["llama-tiny", "qwen3-tiny"])
def test_each_rank_loads_its_cut_of_every_weight(shape: str) -> None:
    """Column cuts of q/k/v and gate/up land in the fused projections head by head; row cuts
    of o_proj/down_proj by input columns; vocabulary rows padded for the last rank. Loading
    runs no collective, so one process builds every rank's part."""
    config = get_shape(shape)
    if shape == "llama-tiny":  # an odd vocabulary: the last rank's rows end in padding
        config = dataclasses.replace(config, vocab_size=511)
    whole = _whole_model(config, seed=5)
    size = 2
    c = rank_config(config, size)
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    for rank in range(size):
        tp = TensorParallel(rank=rank, size=size)
        part = build_empty(config, torch.float32, CPU, tensor_parallel=tp)
        with torch.no_grad():
            part.load_weights(
                shard_weights(iter_random_weights(config, 5, CPU), config, tp), "random"
            )
        w = whole.model.layers[1]
        p = part.model.layers[1]
        qkv = w.self_attn.qkv_proj.weight
        full_q, full_k, full_v = qkv.split([config.q_size, config.kv_size, config.kv_size])
        expected_qkv = torch.cat(
            [
                full_q[rank * q : (rank + 1) * q],
                full_k[rank * kv : (rank + 1) * kv],
                full_v[rank * kv : (rank + 1) * kv],
            ]
        )
        assert torch.equal(p.self_attn.qkv_proj.weight, expected_qkv)
        o = w.self_attn.o_proj.weight
        assert torch.equal(p.self_attn.o_proj.weight, o[:, rank * q : (rank + 1) * q])
        gate, up = w.mlp.gate_up_proj.weight.split(config.intermediate_size)
        expected_gate_up = torch.cat(
            [gate[rank * inter : (rank + 1) * inter], up[rank * inter : (rank + 1) * inter]]
        )
        assert torch.equal(p.mlp.gate_up_proj.weight, expected_gate_up)
        down = w.mlp.down_proj.weight
        assert torch.equal(p.mlp.down_proj.weight, down[:, rank * inter : (rank + 1) * inter])
        assert torch.equal(p.input_layernorm.weight, w.input_layernorm.weight)
        n = rows_per_rank(config.vocab_size, size)
        rows = whole.model.embed_tokens.weight[rank * n : (rank + 1) * n]
        embed = part.model.embed_tokens.weight
        assert torch.equal(embed[: rows.shape[0]], rows)
        assert not embed[rows.shape[0] :].any()  # padding rows past the vocabulary
        if config.tie_word_embeddings:
            assert part.lm_head.weight is part.model.embed_tokens.weight
        else:
            head_rows = whole.lm_head.weight[rank * n : (rank + 1) * n]
            assert torch.equal(part.lm_head.weight[: head_rows.shape[0]], head_rows)


def test_each_rank_loads_its_cut_of_the_fp8_quantization() -> None:
    """The stream quantized before it is cut (`quantize_weight_stream`) gives each rank the
    single-device `quantize_projections` codes, column projections' channel scales cut with
    their rows and row projections' scales whole."""
    from davit_engine.quant.fp8_linear import (
        Fp8Linear,
        quantize_projections,
        quantize_weight_stream,
    )

    config = get_shape("qwen3-tiny")
    whole = _whole_model(config, seed=5)
    quantize_projections(whole)
    size = 2
    c = rank_config(config, size)
    for rank in range(size):
        tp = TensorParallel(rank=rank, size=size)
        part = build_empty(config, torch.float32, CPU, fp8_projections=True, tensor_parallel=tp)
        stream = quantize_weight_stream(iter_random_weights(config, 5, CPU), torch.float32, CPU)
        with torch.no_grad():
            part.load_weights(shard_weights(stream, config, tp), "random")
        for index in range(config.num_layers):
            w, p = whole.model.layers[index], part.model.layers[index]
            cuts = {  # (whole module, rank module, rows of each part or None, columns or None)
                "o_proj": (w.self_attn.o_proj, p.self_attn.o_proj, None, c.q_size),
                "down_proj": (w.mlp.down_proj, p.mlp.down_proj, None, c.intermediate_size),
                "gate_up_proj": (w.mlp.gate_up_proj, p.mlp.gate_up_proj,
                                 [config.intermediate_size] * 2, None),
            }  # fmt: skip
            for name, (full, mine, parts, columns) in cuts.items():
                assert isinstance(full, Fp8Linear) and isinstance(mine, Fp8Linear)
                codes, scale = full.weight.view(torch.uint8), full.weight_scale
                if columns is not None:  # row-parallel: input columns cut, scales whole
                    codes = codes[:, rank * columns : (rank + 1) * columns]
                else:
                    assert parts is not None
                    n = parts[0] // size
                    rows = [t[rank * n : (rank + 1) * n] for t in codes.split(parts)]
                    scales = [t[rank * n : (rank + 1) * n] for t in scale.split(parts)]
                    codes, scale = torch.cat(rows), torch.cat(scales)
                assert torch.equal(mine.weight.view(torch.uint8), codes), name
                assert torch.equal(mine.weight_scale, scale), name
