"""Calibrated KV scales: what the calibration prefill measures, per layer or per head, and on
SmolLM2's real weights that a real text's keys and values stay within the headroom."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.loader import load_model
from davit_engine.models.llama import LlamaAttention
from davit_engine.quant.kv_scales import (
    HEADROOM,
    calibrate_kv_scales,
    calibration_ids,
    measure_kv_amax,
    scales_from_amax,
)
from davit_engine.tokenizer import load_tokenizer

CPU = torch.device("cpu")
TEXT = Path(__file__).resolve().parents[2] / "data" / "text" / "tom-sawyer-chapter-1.txt"


def _attentions(model: torch.nn.Module) -> list[LlamaAttention]:
    return [m for m in model.modules() if isinstance(m, LlamaAttention)]


def test_calibration_sets_every_layer_from_its_maxima() -> None:
    loaded = load_model(EngineConfig(model="random:qwen3-tiny", dtype="float32"), CPU)
    model, c = loaded.model, loaded.config
    ids = calibration_ids(c, 64, seed=1)
    assert ids[0] == c.bos_token_id or c.bos_token_id is None
    amax = measure_kv_amax(model, ids, CPU, torch.float32)
    assert amax.shape == (c.num_layers, 2, c.num_kv_heads) and (amax > 0).all()
    scales = calibrate_kv_scales(model, CPU, torch.float32, num_tokens=64, seed=1)
    per_layer = amax.amax(dim=2, keepdim=True) * HEADROOM / 448
    assert torch.allclose(scales, per_layer.expand_as(scales))
    for attention, expected in zip(_attentions(model), scales, strict=True):
        assert torch.equal(attention.kv_scale, expected)
    per_head = scales_from_amax(amax, per_head=True, headroom=1.0)
    assert torch.allclose(per_head, amax / 448)


def test_load_with_fp8_kv_calibrates_deterministically() -> None:
    config = EngineConfig(model="random:qwen3-tiny", dtype="float32", kv_cache_dtype="fp8")
    one = load_model(config, CPU)
    two = load_model(config, CPU)
    assert one.kv_scale_source == "calibrated" and one.kv_storage_dtype == torch.float8_e4m3fn
    for a, b in zip(_attentions(one.model), _attentions(two.model), strict=True):
        assert torch.equal(a.kv_scale, b.kv_scale)
        assert not torch.equal(a.kv_scale, torch.ones_like(a.kv_scale))


@pytest.mark.slow
def test_real_text_stays_within_the_headroom(smollm2_gguf: Path) -> None:
    """SmolLM2: every layer's largest (rotated) key and value over 2,048 tokens of real text is
    above what 512 random ids reach in some layers, but below HEADROOM times it in all."""
    config = EngineConfig(model=str(smollm2_gguf), device="cpu")
    loaded = load_model(config, CPU)
    model = loaded.model
    text_ids = torch.tensor(load_tokenizer(config).encode(TEXT.read_text())[:2048])
    calibration = measure_kv_amax(model, calibration_ids(loaded.config, 512, 0), CPU, torch.float32)
    text = measure_kv_amax(model, text_ids, CPU, torch.float32)
    ratio = text.amax(dim=2) / calibration.amax(dim=2)  # [layers, keys/values]
    assert ratio.max() > 1.2  # real text does go beyond the calibration...
    assert ratio.max() < HEADROOM  # ...but never into saturation
