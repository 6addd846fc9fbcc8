"""Loader errors name the file or field; GGUF q/k un-permutation; dtype selection."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.loader import build_empty, load_model, read_model_config, resolve_dtype
from davit_engine.loader.gguf_file import hf_name, unpermute_qk
from davit_engine.shapes import SHAPES, get_shape
from davit_engine.types import ParamError

CPU = torch.device("cpu")


def load(model: str, **kwargs: object) -> None:
    load_model(EngineConfig(model=model, **kwargs), CPU)  # type: ignore[arg-type]


def test_missing_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(ParamError, match="no such file or directory") as err:
        load(str(tmp_path / "absent"))
    assert err.value.param == "model" and "absent" in err.value.message
    with pytest.raises(ParamError, match="GGUF file not found"):
        load(str(tmp_path / "absent.gguf"))
    with pytest.raises(ParamError, match="no config.json"):
        load(str(tmp_path))


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with pytest.raises(ParamError, match="unsupported model_type 'gpt2'") as err:
        load(str(tmp_path))
    assert "config.json" in err.value.message


def test_unknown_shape_lists_known_ones() -> None:
    with pytest.raises(ParamError, match="qwen3-0.6b"):
        get_shape("gpt-5")


def test_bad_config_field_is_named(qwen3_tiny_dir: Path, tmp_path: Path) -> None:
    raw = json.loads((qwen3_tiny_dir / "config.json").read_text())
    raw["num_key_value_heads"] = 3  # 4 query heads are not a multiple of 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ParamError, match="num_key_value_heads"):
        read_model_config(str(tmp_path))
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ParamError, match="'hidden_size' is missing"):
        read_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ParamError, match="cannot be read as JSON"):
        read_model_config(str(tmp_path))


def test_weight_shape_mismatch_names_the_tensor(qwen3_tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copy(qwen3_tiny_dir / "model.safetensors", tmp_path / "model.safetensors")
    raw = json.loads((qwen3_tiny_dir / "config.json").read_text())
    raw["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ParamError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"
    ):
        load(str(tmp_path))


def test_missing_weights_are_reported(qwen3_tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copy(qwen3_tiny_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ParamError, match="no .safetensors weight files"):
        load(str(tmp_path))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(qwen3_tiny_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ParamError, match="1 tensors are missing, e.g. model.layers.1.self_attn.k_norm"
    ):
        load(str(tmp_path))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"definitely not gguf")
    with pytest.raises(ParamError, match="not a readable GGUF file"):
        load(str(bogus))


def test_unpermute_inverts_the_converter_layout() -> None:
    heads, head_dim, cols = 3, 8, 5
    original = torch.randn(heads * head_dim, cols)
    # The converter's layout: per head, rows (half, pair) interleaved from (pair, half).
    converted = (
        original.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(original.shape)
    )
    assert not torch.equal(converted, original)
    assert torch.equal(unpermute_qk(converted, heads), original)


def test_gguf_names_map_to_checkpoint_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None


def test_dtype_resolution() -> None:
    shape = SHAPES["qwen3-tiny"]
    assert resolve_dtype("auto", "gguf", shape, CPU) == torch.float32
    assert resolve_dtype("auto", "random", shape, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", "gguf", shape, CPU) == torch.bfloat16
    with pytest.raises(ParamError) as err:
        resolve_dtype("float64", "gguf", shape, CPU)
    assert err.value.param == "--dtype"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_random_model_loads_in_each_dtype(dtype: str) -> None:
    loaded = load_model(EngineConfig(model="random:qwen3-tiny", dtype=dtype), CPU)  # type: ignore[arg-type]
    assert loaded.dtype == getattr(torch, dtype)
    assert all(p.dtype == loaded.dtype for p in loaded.model.parameters())
    assert (
        loaded.model.lm_head.weight.data_ptr() != loaded.model.model.embed_tokens.weight.data_ptr()
    )
    tied = build_empty(
        dataclasses.replace(SHAPES["qwen3-tiny"], tie_word_embeddings=True), loaded.dtype, CPU
    )
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
