"""Named random-weight shapes: valid, the published parameter counts, and the same model as
transformers builds from the config.json we derive (parameter names and shapes, rotary
frequencies), so greedy parity runs compare like with like."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from davit_engine.layers.rotary import rope_inverse_frequencies
from davit_engine.loader import build_empty
from davit_engine.loader.hf_config import model_config_from_hf, model_config_to_hf
from davit_engine.shapes import SHAPES, get_shape
from davit_engine.types import ParamError

# Parameter counts of the published checkpoints (tied embeddings counted once).
PUBLISHED_PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768,
    "llama-3.2-1b": 1_235_814_400,
}
COMPARED = ["qwen2.5-0.5b", "llama-3.2-1b", "qwen2-tiny", "llama-tiny", "qwen3-tiny"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_is_valid_and_survives_config_json(name: str) -> None:
    shape = get_shape(name)
    shape.validate(name)
    parsed = model_config_from_hf(model_config_to_hf(shape), name)
    assert dataclasses.replace(parsed, torch_dtype=None) == shape


def test_unknown_shape_names_the_known_ones() -> None:
    with pytest.raises(ParamError, match="llama-3.2-1b") as err:
        get_shape("llama-3.2-2b")
    assert err.value.param == "model"


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_published_parameter_counts(name: str) -> None:
    assert SHAPES[name].num_parameters() == PUBLISHED_PARAMETERS[name]


def test_new_family_shapes_carry_their_family_traits() -> None:
    qwen2, llama = SHAPES["qwen2.5-0.5b"], SHAPES["llama-3.2-1b"]
    assert qwen2.architecture == "qwen2" and qwen2.attention_bias and not qwen2.qk_norm
    assert llama.architecture == "llama" and not llama.attention_bias
    assert llama.rope_scaling is not None and llama.rope_scaling["factor"] == 32.0
    assert qwen2.tie_word_embeddings and llama.tie_word_embeddings


@pytest.mark.parametrize("name", COMPARED)
def test_transformers_builds_the_same_model(name: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[name]
    raw = model_config_to_hf(shape)
    raw.pop("architectures")
    hf_config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in hf.parameters()) == shape.num_parameters()

    ours = build_empty(shape, torch.float32, torch.device("meta"))
    expected: dict[str, tuple[int, ...]] = {}
    for param_name, param in ours.state_dict().items():
        if param_name == "lm_head.weight" and shape.tie_word_embeddings:
            continue
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in param_name), None)
        if fused is None:
            expected[param_name] = tuple(param.shape)
            continue
        bounds = ours._shard_bounds(fused)
        parts = ("q_proj", "k_proj", "v_proj") if fused == "qkv_proj" else ("gate_proj", "up_proj")
        for i, part in enumerate(parts):
            rows = bounds[i + 1] - bounds[i]
            expected[param_name.replace(f".{fused}.", f".{part}.")] = (rows, *param.shape[1:])
    theirs = {
        k: tuple(v.shape)
        for k, v in hf.state_dict().items()
        if not (k == "lm_head.weight" and shape.tie_word_embeddings)
    }
    assert expected == theirs

    rotary_class = type(hf.model.rotary_emb)
    their_freqs = rotary_class(config=hf_config).inv_freq
    our_freqs = rope_inverse_frequencies(shape.head_dim, shape.rope_theta, shape.rope_scaling)
    torch.testing.assert_close(their_freqs, our_freqs, rtol=1e-6, atol=0.0)
